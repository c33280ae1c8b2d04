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
//!
//! [`Injector::batch`] runs several system calls in one stop instead of two
//! per call: a few bytes of code written into an executable page of the
//! tracee (the caller's) set each call's registers, make it and store its
//! result, then end on an `int3`. The tracee is resumed with PTRACE_CONT
//! and stops once, at the SIGTRAP of that `int3`, which the tracer takes
//! and discards. That SIGTRAP is forced by the kernel: forced while blocked
//! or ignored it would reset the program's SIGTRAP action to SIG_DFL (the
//! lesson of single-stepping), so during a batch every signal but SIGTRAP
//! is blocked, and the caller batches only a thread whose SIGTRAP is
//! neither ignored nor pending ([`trap_free`]).

use crate::error::{Errno, Result, SysError};
use crate::ptrace::{Stop, Tracee, PTRACE_EVENT_CLONE, PTRACE_EVENT_FORK, PTRACE_EVENT_STOP};
use crate::regs::UserRegs;
use std::cell::Cell;
use std::os::unix::fs::FileExt;

thread_local! {
    /// Stops of tracees this thread waited for while injecting.
    static STOPS: Cell<u64> = const { Cell::new(0) };
}

/// How many stops of tracees the calling thread has waited for while
/// injecting system calls (for the debug log: the difference over a step).
pub fn stops() -> u64 {
    STOPS.with(Cell::get)
}

fn count_stop() {
    STOPS.with(|c| c.set(c.get() + 1));
}

/// The most system calls one [`Injector::batch`] runs: its code and
/// results fill one page.
pub const BATCH_MAX: usize = 45;
/// The most arguments of one batch that are results of earlier calls of
/// it ([`Arg::ResultOf`]): each takes 3 bytes more code.
pub const BATCH_LINKS_MAX: usize = 14;
/// Bytes of code per call of a batch (7 x `mov r64, imm64`, `syscall`,
/// `mov [abs64], rax`).
const CALL_CODE: u64 = 82;
/// Bytes of code an argument taken from an earlier result adds
/// (`mov rax, [abs64]` and `mov r64, rax` instead of `mov r64, imm64`).
const LINK_CODE: u64 = 3;
/// Where a batch's results are, from the start of its code page.
const RESULTS_AT: u64 = crate::PAGE_SIZE - 8 * BATCH_MAX as u64;
// The code of a full batch and its int3 fit before the results.
const _: () =
    assert!(BATCH_MAX as u64 * CALL_CODE + BATCH_LINKS_MAX as u64 * LINK_CODE < RESULTS_AT);
/// si_code of a signal the kernel sends (an `int3`'s SIGTRAP).
const SI_KERNEL: i32 = 0x80;

/// An argument of a call in a batch ([`Injector::batch_linked`]): a
/// value, or the raw result of an earlier call of the same batch (its
/// index), e.g. the fd a `pidfd_getfd` returned, moved by the next call.
/// A failed call's result is `-errno`: the calls using it fail too (an fd
/// of -9 is EBADF), and the first failure is the one to report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arg {
    Val(u64),
    ResultOf(usize),
}

impl Arg {
    /// The argument's value, given the raw results of the calls before it
    /// (for calls made one by one instead of in a batch).
    pub fn value(self, results: &[i64]) -> u64 {
        match self {
            Arg::Val(v) => v,
            Arg::ResultOf(k) => results.get(k).copied().unwrap_or(-libc::EBADF as i64) as u64,
        }
    }
}

/// The machine code (x86-64) of a batch: each call's arguments into their
/// registers (a value, or an earlier call's stored result), its number,
/// `syscall`, its result stored at `results + 8 * i`; then `int3`.
fn batch_code(calls: &[(i64, [Arg; 6])], results: u64) -> Vec<u8> {
    /// `rex opcode imm64`: `mov r64, imm64`, `mov [abs64], rax` or
    /// `mov rax, [abs64]`.
    fn imm(c: &mut Vec<u8>, rex: u8, opcode: u8, v: u64) {
        c.extend_from_slice(&[rex, opcode]);
        c.extend_from_slice(&v.to_le_bytes());
    }
    // Per argument register (rdi, rsi, rdx, r10, r8, r9): the REX prefix
    // and opcode of `mov r64, imm64`, and the REX prefix and ModRM byte of
    // `mov r64, rax` (89 /r).
    const REGS: [(u8, u8, u8, u8); 6] = [
        (0x48, 0xbf, 0x48, 0xc7),
        (0x48, 0xbe, 0x48, 0xc6),
        (0x48, 0xba, 0x48, 0xc2),
        (0x49, 0xba, 0x49, 0xc2),
        (0x49, 0xb8, 0x49, 0xc0),
        (0x49, 0xb9, 0x49, 0xc1),
    ];
    let mut c = Vec::with_capacity(calls.len() * CALL_CODE as usize + 1);
    for (i, (nr, a)) in calls.iter().enumerate() {
        for (arg, &(rex, op, rex_rax, modrm)) in a.iter().zip(REGS.iter()) {
            match *arg {
                Arg::Val(v) => imm(&mut c, rex, op, v),
                Arg::ResultOf(k) => {
                    assert!(k < i, "call {i} of a batch uses the result of call {k}");
                    imm(&mut c, 0x48, 0xa1, results + 8 * k as u64); // mov rax, [results + 8k]
                    c.extend_from_slice(&[rex_rax, 0x89, modrm]); // mov r64, rax
                }
            }
        }
        imm(&mut c, 0x48, 0xb8, *nr as u64); // mov rax, nr
        c.extend_from_slice(&[0x0f, 0x05]); // syscall
        imm(&mut c, 0x48, 0xa3, results + 8 * i as u64); // mov [results + 8i], rax
    }
    c.push(0xcc); // int3
    c
}

/// Whether thread `tid` of process `pid` can run a batch: SIGTRAP neither
/// ignored nor pending (for the thread or the process), and no seccomp
/// filter (one could refuse, or kill for, the executable page a batch
/// runs from).
pub fn trap_free(pid: i32, tid: i32) -> bool {
    let trap = 1u64 << (libc::SIGTRAP - 1);
    crate::proc::task_sig_state(pid, tid).is_ok_and(|st| {
        (st.sigign | st.sigpnd | st.shdpnd) & trap == 0 && st.seccomp.unwrap_or(1) == 0
    })
}

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
                count_stop();
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
                    // SIGSTOP, which no mask holds back, sent while we
                    // inject (or pending from before: a stopped process
                    // sent SIGSTOP again): taken, kept and sent again at
                    // the detach, so the injection goes on.
                    Stop::Signal(sig) if is_stop_signal(sig) => {
                        self.t.take_stop(sig);
                        self.t.resume(req, 0)?;
                    }
                    other => return Err(unexpected(self.t.tid(), other, phase)),
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

    /// Run `calls` (number, arguments) one after the other in one stop;
    /// their raw results (`-errno` on failure), in order. `code` is a page
    /// of the tracee that is executable and writable (the code and the
    /// results go there); at most [`BATCH_MAX`] calls. Only for a thread
    /// that is [`trap_free`] (see the module docs).
    pub fn batch(&mut self, code: u64, calls: &[(i64, [u64; 6])]) -> Result<Vec<i64>> {
        let calls: Vec<(i64, [Arg; 6])> =
            calls.iter().map(|&(nr, a)| (nr, a.map(Arg::Val))).collect();
        self.batch_linked(code, &calls)
    }

    /// [`Injector::batch`] of calls whose arguments may be results of
    /// earlier calls of the batch ([`Arg::ResultOf`], at most
    /// [`BATCH_LINKS_MAX`] of them).
    pub fn batch_linked(&mut self, code: u64, calls: &[(i64, [Arg; 6])]) -> Result<Vec<i64>> {
        assert!(calls.len() <= BATCH_MAX, "batch of {} calls", calls.len());
        let links = calls
            .iter()
            .flat_map(|(_, a)| a.iter())
            .filter(|a| matches!(a, Arg::ResultOf(_)))
            .count();
        assert!(
            links <= BATCH_LINKS_MAX,
            "batch with {links} linked arguments"
        );
        let tid = self.t.tid();
        let bytes = batch_code(calls, code + RESULTS_AT);
        crate::mem::write_vm(tid, code, &bytes)?;
        let mut regs = self.saved;
        regs.rip = code;
        // As for one call: no syscall restart on resume.
        regs.orig_rax = u64::MAX;
        self.t.set_regs(&regs)?;
        let trap = 1u64 << (libc::SIGTRAP - 1);
        self.t.set_sigmask(!trap)?;
        let end = code + bytes.len() as u64;
        let ran = self.run_to_trap(end);
        // Blocked again before anything else can happen (the drop puts the
        // program's own mask back).
        self.t.set_sigmask(!0u64)?;
        let foreign = ran?;
        if let Some(info) = foreign {
            // A SIGTRAP someone sent meanwhile was taken for the program:
            // sent again, pending until the program runs.
            let tgid = crate::proc::status(tid).map_or(tid, |s| s.tgid);
            tracing::debug!(
                tid,
                code = i32::from_le_bytes([info[8], info[9], info[10], info[11]]),
                "SIGTRAP sent to the program during a batch: sent again"
            );
            crate::coop::tgkill(tgid, tid, libc::SIGTRAP)?;
        }
        let mut raw = vec![0u8; calls.len() * 8];
        crate::mem::read_vm(tid, code + RESULTS_AT, &mut raw)?;
        Ok(raw
            .chunks_exact(8)
            .map(|w| i64::from_le_bytes(w.try_into().unwrap_or([0; 8])))
            .collect())
    }

    /// Resume the tracee until it stops at the SIGTRAP of the `int3` that
    /// ends at `end`. Returns the siginfo of a SIGTRAP someone else sent
    /// meanwhile, which was taken from the program's queue.
    fn run_to_trap(&mut self, end: u64) -> Result<Option<[u8; crate::ptrace::SIGINFO_SIZE]>> {
        let mut foreign = None;
        let mut group_stops = 0;
        self.t.resume(libc::PTRACE_CONT, 0)?;
        loop {
            let stop = self.t.wait_stop()?;
            count_stop();
            tracing::trace!(tid = self.t.tid(), ?stop, "stop while running a batch");
            match stop {
                Stop::Signal(libc::SIGTRAP) => {
                    let info = self.t.siginfo()?;
                    let code = i32::from_le_bytes([info[8], info[9], info[10], info[11]]);
                    let at_end = self.t.get_regs()?.rip == end;
                    if !(at_end && code == SI_KERNEL) {
                        // Not ours (ours, if merged into it, is gone too).
                        foreign = Some(info);
                    }
                    if at_end {
                        return Ok(foreign);
                    }
                    // Discarded now, sent again once the batch is done.
                    self.t.resume(libc::PTRACE_CONT, 0)?;
                }
                // As in `syscall_raw`: a stopped process reports its
                // group-stop again once resumed.
                Stop::Event { event, sig }
                    if event == PTRACE_EVENT_STOP && is_stop_signal(sig) && group_stops < 4 =>
                {
                    group_stops += 1;
                    self.t.resume(libc::PTRACE_CONT, 0)?;
                }
                // As in `syscall_raw`: a SIGSTOP taken, sent again at the detach.
                Stop::Signal(sig) if is_stop_signal(sig) => {
                    self.t.take_stop(sig);
                    self.t.resume(libc::PTRACE_CONT, 0)?;
                }
                other => return Err(unexpected(self.t.tid(), other, "batch")),
            }
        }
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

    /// Hand the tracee over to another thread of ours (see
    /// [`Tracee::park`]): it is left in `pause` (every signal blocked,
    /// so only ptrace's interrupt ends it), entered at the syscall-entry
    /// stop where it is detached. [`Injector::unpark`] on the other
    /// thread takes it, and the injector goes on there (it is `Send`).
    pub fn park(&mut self) -> Result<()> {
        let mut regs = self.saved;
        regs.rip = self.ip;
        regs.rax = libc::SYS_pause as u64;
        regs.orig_rax = u64::MAX;
        self.t.set_regs(&regs)?;
        self.t.resume(libc::PTRACE_SYSCALL, 0)?;
        loop {
            let stop = self.t.wait_stop()?;
            count_stop();
            match stop {
                Stop::Syscall => break,
                Stop::Signal(sig) if is_stop_signal(sig) => {
                    self.t.take_stop(sig);
                    self.t.resume(libc::PTRACE_SYSCALL, 0)?;
                }
                other => return Err(unexpected(self.t.tid(), other, "park")),
            }
        }
        self.t.park()
    }

    /// Take a tracee [`Injector::park`]ed by another thread, traced from
    /// now on by this one with `options` (PTRACE_O_*).
    pub fn unpark(&mut self, options: u64) -> Result<()> {
        self.t.unpark(options)?;
        count_stop();
        Ok(())
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
    find_syscall_insn_outside(pid, 0, 0)
}

/// [`find_syscall_insn`] in a mapping other than the one at `[start, end)`
/// (about to go).
pub fn find_syscall_insn_outside(pid: i32, start: u64, end: u64) -> Result<u64> {
    let maps = crate::proc::maps(pid)?;
    let maps: Vec<_> = maps
        .into_iter()
        .filter(|m| (m.start, m.end) != (start, end))
        .collect();
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

/// The error of a stop an injection did not expect.
fn unexpected(tid: i32, stop: Stop, during: &'static str) -> SysError {
    SysError::UnexpectedStop {
        tid,
        status: match stop {
            Stop::Signal(s) => s,
            Stop::Event { event, sig } => (event << 16) | sig,
            Stop::Syscall => 0,
        },
        during,
    }
}

fn is_stop_signal(sig: i32) -> bool {
    matches!(
        sig,
        libc::SIGSTOP | libc::SIGTSTP | libc::SIGTTIN | libc::SIGTTOU
    )
}
