//! Running system calls inside a stopped tracee.
//!
//! The tracee's registers are pointed at an existing `syscall` instruction
//! (two bytes `0f 05` found in its vDSO or another executable mapping, so
//! nothing in its memory is modified) and it is resumed with PTRACE_SYSCALL
//! twice: the syscall-entry stop, then the syscall-exit stop where `rax`
//! holds the result (`syscall_raw` says why it is not single-stepped). It
//! never executes a user-space instruction of its own.
//!
//! While an [`Injector`] lives, every signal is blocked in the tracee (so no
//! signal is dequeued by our syscalls); its mask and registers come back
//! when the injector is finished or dropped.

use crate::error::{Errno, Result, SysError};
use crate::ptrace::{Stop, Tracee, PTRACE_EVENT_CLONE, PTRACE_EVENT_FORK, PTRACE_EVENT_STOP};
use crate::regs::UserRegs;
use std::os::unix::fs::FileExt;

pub struct Injector<'a> {
    t: &'a mut Tracee,
    ip: u64,
    saved: UserRegs,
    saved_mask: u64,
    done: bool,
    new_task: Option<i32>,
}

impl<'a> Injector<'a> {
    /// Prepare to inject syscalls into a stopped tracee, executing the
    /// `syscall` instruction at `syscall_ip`.
    pub fn new(t: &'a mut Tracee, syscall_ip: u64) -> Result<Self> {
        let saved = t.get_regs()?;
        let saved_mask = t.get_sigmask()?;
        t.set_sigmask(!0u64)?;
        Ok(Injector {
            t,
            ip: syscall_ip,
            saved,
            saved_mask,
            done: false,
            new_task: None,
        })
    }

    pub fn pid(&self) -> i32 {
        self.t.tid()
    }

    pub fn tracee(&self) -> &Tracee {
        self.t
    }

    /// Use another `syscall` instruction from now on (e.g. after the vDSO moved).
    pub fn set_syscall_ip(&mut self, ip: u64) {
        self.ip = ip;
    }

    /// The PID (in our namespace) of the task the last injected clone3
    /// created; it differs from clone3's result inside a child PID namespace.
    pub fn take_new_task(&mut self) -> Option<i32> {
        self.new_task.take()
    }

    /// Address of the `syscall` instruction in use.
    pub fn syscall_ip(&self) -> u64 {
        self.ip
    }

    /// The registers the tracee had when the injector was created.
    pub fn saved_regs(&self) -> &UserRegs {
        &self.saved
    }

    /// Run syscall `nr` with `args`; returns the raw result (`-errno` on failure).
    pub fn syscall_raw(&mut self, nr: i64, args: [u64; 6]) -> Result<i64> {
        let mut regs = self.saved;
        regs.rip = self.ip;
        regs.rax = nr as u64;
        // Without this, a thread stopped inside an interrupted syscall would
        // have its rip/rax rewritten by the kernel's restart logic on resume.
        regs.orig_rax = u64::MAX;
        regs.rdi = args[0];
        regs.rsi = args[1];
        regs.rdx = args[2];
        regs.r10 = args[3];
        regs.r8 = args[4];
        regs.r9 = args[5];
        self.t.set_regs(&regs)?;
        // Resumed with PTRACE_SYSCALL: two stops, at entry and exit. Not
        // single-stepped over the `syscall` instruction (one stop), for
        // two reasons the kernel gives: the step's SIGTRAP is forced, and
        // a forced signal that is blocked (every signal is, while we
        // inject) resets the tracee's action for it to SIG_DFL (a Go
        // program's SIGTRAP handler was lost at restore); and a step
        // leaves the trap flag set until the next resume that is not a
        // step (PTRACE_SETREGS cannot clear it), so a tracer that dies in
        // between (an agent killed mid-checkpoint) leaves the program to
        // die of SIGTRAP after one instruction.
        let req = libc::PTRACE_SYSCALL;
        let phases = ["syscall entry", "syscall exit"];
        for phase in phases {
            self.t.resume(req, 0)?;
            let mut group_stops = 0;
            loop {
                let stop = self.t.wait_stop()?;
                tracing::trace!(tid = self.t.tid(), nr, phase, ?stop, "stop while injecting");
                match stop {
                    Stop::Syscall => break,
                    // An injected clone3 reports the new thread or process first.
                    Stop::Event { event, .. }
                        if event == PTRACE_EVENT_CLONE || event == PTRACE_EVENT_FORK =>
                    {
                        self.new_task = Some(self.t.event_msg()? as i32);
                        self.t.resume(req, 0)?;
                    }
                    // A process that was stopped (SIGSTOP) when seized reports
                    // its group-stop again once resumed; it stays stopped for
                    // its parent, we just go on.
                    Stop::Event { event, sig }
                        if event == PTRACE_EVENT_STOP && is_stop_signal(sig) && group_stops < 4 =>
                    {
                        group_stops += 1;
                        self.t.resume(req, 0)?;
                    }
                    other => {
                        return Err(SysError::UnexpectedStop {
                            tid: self.t.tid(),
                            status: match other {
                                Stop::Signal(s) => s,
                                Stop::Event { event, sig } => (event << 16) | sig,
                                Stop::Syscall => 0,
                            },
                            during: phase,
                        })
                    }
                }
            }
        }
        let out = self.t.get_regs()?;
        Ok(out.rax as i64)
    }

    /// Run a syscall and turn `-errno` into an error naming it.
    pub fn call(&mut self, name: &'static str, nr: i64, args: [u64; 6]) -> Result<u64> {
        let r = self.syscall_raw(nr, args)?;
        if (-4095..0).contains(&r) {
            return Err(SysError::Remote {
                name,
                pid: self.t.tid(),
                source: Errno(-r as i32),
            });
        }
        Ok(r as u64)
    }

    /// Map `len` bytes of private anonymous read-write memory in the tracee
    /// (exactly at `addr` with MAP_FIXED_NOREPLACE, or anywhere if 0);
    /// returns its address.
    pub fn mmap_anon(&mut self, addr: u64, len: u64) -> Result<u64> {
        let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
        if addr != 0 {
            flags |= libc::MAP_FIXED_NOREPLACE;
        }
        let prot = (libc::PROT_READ | libc::PROT_WRITE) as u64;
        self.call(
            "mmap",
            libc::SYS_mmap,
            [addr, len, prot, flags as u64, u64::MAX, 0],
        )
    }

    /// Put the registers and signal mask back as they were.
    pub fn finish(mut self) -> Result<()> {
        self.restore()
    }

    /// Finish, leaving `mask` as the tracee's signal mask instead of the original.
    pub fn finish_with_mask(mut self, mask: u64) -> Result<()> {
        self.saved_mask = mask;
        self.restore()
    }

    /// [`Injector::finish_with_mask`], then `then` on the tracee (its
    /// final registers, once the injector no longer needs it).
    pub fn finish_with_mask_then<R>(
        mut self,
        mask: u64,
        then: impl FnOnce(&Tracee) -> R,
    ) -> Result<R> {
        self.saved_mask = mask;
        self.restore()?;
        Ok(then(self.t))
    }

    fn restore(&mut self) -> Result<()> {
        if self.done {
            return Ok(());
        }
        self.done = true;
        self.t.set_regs(&self.saved)?;
        self.t.set_sigmask(self.saved_mask)
    }
}

impl Drop for Injector<'_> {
    fn drop(&mut self) {
        let _ = self.restore();
    }
}

/// Find the address of a `syscall` instruction (bytes 0f 05) in the
/// executable mappings of `pid`, preferring the vDSO.
pub fn find_syscall_insn(pid: i32) -> Result<u64> {
    let maps = crate::proc::maps(pid)?;
    let mem_path = format!("/proc/{pid}/mem");
    let mem = std::fs::File::open(&mem_path).map_err(crate::error::io_err(&mem_path))?;
    let mut candidates: Vec<&crate::proc::MapEntry> =
        maps.iter().filter(|m| m.path == "[vdso]").collect();
    candidates.extend(
        maps.iter()
            .filter(|m| m.prot & libc::PROT_EXEC as u32 != 0 && m.path != "[vdso]"),
    );
    for m in candidates {
        if m.prot & libc::PROT_EXEC as u32 == 0 || m.path == "[vsyscall]" {
            continue;
        }
        let len = (m.end - m.start).min(1 << 20) as usize;
        let mut buf = vec![0u8; len];
        if mem.read_exact_at(&mut buf, m.start).is_err() {
            continue;
        }
        if let Some(off) = buf.windows(2).position(|w| w == [0x0f, 0x05]) {
            return Ok(m.start + off as u64);
        }
    }
    Err(SysError::NoSyscallInsn { pid })
}

fn is_stop_signal(sig: i32) -> bool {
    matches!(
        sig,
        libc::SIGSTOP | libc::SIGTSTP | libc::SIGTTIN | libc::SIGTTOU
    )
}
