//! Kind "signals": the action of every signal, the signals pending for the
//! whole process, and per thread its mask, its own pending signals and its
//! alternate signal stack.
//!
//! Capture: masks and pending signals (with their siginfo) come from ptrace
//! (PTRACE_GETSIGMASK, PTRACE_PEEKSIGINFO), nothing is dequeued; actions
//! and alternate stacks from injected rt_sigaction / sigaltstack. Each
//! injected call is a round trip through the frozen thread (a ptrace stop
//! to wait for: milliseconds on a loaded machine), so rt_sigaction is
//! asked only for the signals the process catches or ignores (SigCgt and
//! SigIgn of /proc/PID/status) and for SIGCHLD (whose SA_NOCLDSTOP and
//! SA_NOCLDWAIT act even with the default action); every other signal has
//! its default action, whose flags and mask have no effect (they are
//! restored as zero: a program reading its old action back sees no
//! flags). Restore:
//! the stub inherited our actions; for the same reason, only the signals
//! the process had another action for, those the stub catches or ignores
//! (its own SigCgt and SigIgn) and SIGCHLD are set, each an injected call
//! (62 calls for every process were a third of a small process's rebuild
//! in a tree restore, see docs/PERFORMANCE.md); pending signals
//! are queued again, the process's from its main thread and each thread's
//! from that thread (the kernel lets a thread send itself any si_code, but
//! not another thread a tgkill's), and stay blocked until the release;
//! each thread's mask is set when its injector finishes.

#[cfg(test)]
mod tests;

use crate::capture::Proc;
use crate::error::{CheckpointError, RestoreError, StepContext};
use crate::kinds::Kind;
use crate::restore::Rebuild;
use cr_image::model::signals::NSIG;
use cr_image::model::{Process, SigAction, SigInfo, Thread};
use cr_sys::mem;
use cr_sys::remote::Injector;

pub struct Signals;

fn siginfos(raw: Vec<Vec<u8>>) -> Vec<SigInfo> {
    raw.into_iter()
        .filter_map(|b| b.try_into().ok().map(SigInfo::new))
        .collect()
}

impl Kind for Signals {
    const NAME: &'static str = "signals";

    fn capture(cx: &mut Proc<'_, '_>, p: &mut Process) -> Result<(), CheckpointError> {
        let pid = cx.pid;
        let sys = |e| CheckpointError::from_sys(pid, e);
        let tracees = cx.probe.tracees();
        p.signals.shared_pending = siginfos(tracees[0].pending_signals(true).map_err(sys)?);
        for (t, th) in tracees.iter().zip(p.threads.iter_mut()) {
            th.sigmask = t.get_sigmask().map_err(sys)?;
            th.pending = siginfos(t.pending_signals(false).map_err(sys)?);
        }
        // Each thread's alternate signal stack: read by kind "threads",
        // in the same stop of the thread as its other per-thread state.
        p.signals.actions = actions(cx);
        Ok(())
    }

    /// Every signal's action (the stub inherited ours): those that are not
    /// the default in the image or in the stub, and SIGCHLD.
    fn restore(cx: &mut Rebuild<'_, '_, '_>, p: &Process) -> Result<(), RestoreError> {
        let stub = &mut cx.stub;
        let own = cr_sys::proc::status(stub.inj.pid())?;
        let not_default = own.sigcgt | own.sigign | bit(libc::SIGCHLD as u32);
        for sig in 1..=NSIG {
            if sig == libc::SIGKILL as u32 || sig == libc::SIGSTOP as u32 {
                continue;
            }
            let a = p.signals.action(sig);
            if a.is_none() && not_default & bit(sig) == 0 {
                continue;
            }
            let mut act = Vec::with_capacity(32);
            for v in [
                a.map_or(0, |a| a.handler),
                a.map_or(0, |a| a.flags),
                a.map_or(0, |a| a.restorer),
                a.map_or(0, |a| a.mask),
            ] {
                act.extend_from_slice(&v.to_le_bytes());
            }
            let addr = stub.put(&act)?;
            let args = [sig as u64, addr, 0, 8, 0, 0];
            let what = || format!("cannot restore the action of signal {sig}");
            if sig == libc::SIGTRAP as u32 {
                // Alone, after the ones queued: the `int3` ending a batch
                // would reset an ignored SIGTRAP to SIG_DFL (then no more
                // batches: `Stub::flush` looks before each).
                stub.call("rt_sigaction", libc::SYS_rt_sigaction, args)
                    .step(what)?;
            } else {
                stub.later("rt_sigaction", libc::SYS_rt_sigaction, args, what())?;
            }
        }
        stub.flush()?;
        Ok(())
    }
}

/// Every signal's disposition, read with rt_sigaction(sig, NULL, &old).
/// Signal `sig`'s bit in a signal set of /proc/PID/status.
fn bit(sig: u32) -> u64 {
    1u64 << (sig - 1)
}

/// The action of every signal the main thread was asked about
/// (`crate::asked`); the others have their default action.
fn actions(cx: &Proc<'_, '_>) -> Vec<SigAction> {
    let raw = &cx.main.actions;
    let mut out = Vec::new();
    for sig in 1..=NSIG {
        let w = |i: usize| crate::probe::word(raw, (sig as usize - 1) * 4 + i);
        let (handler, flags, restorer, mask) = (w(0), w(1), w(2), w(3));
        if handler != 0 || flags != 0 || mask != 0 {
            out.push(SigAction {
                signo: sig,
                handler,
                flags,
                restorer,
                mask,
            });
        }
    }
    out
}

/// A thread's alternate signal stack (the stub inherited ours: always
/// replaced). `args` is scratch memory of the stub.
pub fn restore_thread(
    inj: &mut Injector<'_>,
    pid: i32,
    args: u64,
    th: &Thread,
) -> Result<(), RestoreError> {
    let ss = th.sigaltstack;
    let flags = if ss.flags & libc::SS_DISABLE != 0 {
        libc::SS_DISABLE
    } else {
        // SS_ONSTACK is a state, not a setting.
        ss.flags & !libc::SS_ONSTACK
    };
    let mut stack_t = Vec::with_capacity(24);
    stack_t.extend_from_slice(&ss.sp.to_le_bytes());
    stack_t.extend_from_slice(&(flags as u32 as u64).to_le_bytes());
    stack_t.extend_from_slice(&ss.size.to_le_bytes());
    mem::write_vm(pid, args, &stack_t)?;
    inj.call("sigaltstack", libc::SYS_sigaltstack, [args, 0, 0, 0, 0, 0])
        .step(|| format!("cannot set the alternate signal stack of thread {}", th.tid))?;
    Ok(())
}

/// Queue again every signal that was pending for the whole process, and
/// the main thread's own, with their siginfo, from the main thread; they
/// stay pending (blocked) until the release. The other threads queue
/// their own ([`queue_thread_pending`]).
pub fn queue_pending(cx: &mut Rebuild<'_, '_, '_>, p: &Process) -> Result<(), RestoreError> {
    let ids = &cx.r.ids;
    let pid = ids.inner(p.pid) as u64;
    let stub = &mut cx.stub;
    for info in &p.signals.shared_pending {
        let sig = info.signo();
        let addr = stub.put(info.bytes())?;
        stub.call(
            "rt_sigqueueinfo",
            libc::SYS_rt_sigqueueinfo,
            [pid, sig as u64, addr, 0, 0, 0],
        )
        .step(|| format!("cannot queue pending signal {sig}"))?;
    }
    let main = &p.threads[0];
    for info in &main.pending {
        let addr = stub.put(info.bytes())?;
        queue_for_thread(
            &mut stub.inj,
            pid,
            ids.inner_tid(main) as u64,
            addr,
            info,
            main,
        )?;
    }
    Ok(())
}

/// Queue again the signals pending for thread `th` alone, from inside that
/// thread (`inj` runs in it; `args` is scratch memory of the stub, whose
/// PID here is `pid`; `ids` are the process's and the thread's IDs in the
/// process's PID namespace).
///
/// The kernel lets only the target thread itself queue a signal whose
/// siginfo says it came from kill/tgkill (`si_code` >= 0 or SI_TKILL, what
/// `pthread_kill` sends): rt_tgsigqueueinfo from another thread of the
/// same process fails with EPERM.
pub fn queue_thread_pending(
    inj: &mut Injector<'_>,
    pid: i32,
    ids: (u32, u32),
    args: u64,
    th: &Thread,
) -> Result<(), RestoreError> {
    for info in &th.pending {
        mem::write_vm(pid, args, info.bytes())?;
        queue_for_thread(inj, ids.0 as u64, ids.1 as u64, args, info, th)?;
    }
    Ok(())
}

fn queue_for_thread(
    inj: &mut Injector<'_>,
    pid: u64,
    tid: u64,
    addr: u64,
    info: &SigInfo,
    th: &Thread,
) -> Result<(), RestoreError> {
    let sig = info.signo();
    inj.call(
        "rt_tgsigqueueinfo",
        libc::SYS_rt_tgsigqueueinfo,
        [pid, tid, sig as u64, addr, 0, 0],
    )
    .step(|| format!("cannot queue pending signal {sig} of thread {}", th.tid))?;
    Ok(())
}

/// `--verify`: every signal's action, and the signals pending for the
/// whole process (by number; the thread's part is kind "threads").
pub fn verify(c: &mut crate::verify::Compare<'_>, image: &Process, now: &Process) {
    let (a, b) = (&image.signals, &now.signals);
    let signos = |v: &[cr_image::model::SigAction]| v.iter().map(|x| x.signo).collect::<Vec<_>>();
    if c.same(
        "signal actions",
        "signals handled or ignored",
        &signos(&a.actions),
        &signos(&b.actions),
    ) {
        for (x, y) in a.actions.iter().zip(&b.actions) {
            c.same("signal actions", &format!("signal {}", x.signo), x, y);
        }
    }
    let timers = timer_signals(image, None);
    c.same(
        "signals",
        "pending for the process",
        &pending_signals(&a.shared_pending, &timers),
        &pending_signals(&b.shared_pending, &timers),
    );
}

/// The signals of `v` by number, but those the armed timers send
/// (`timers`): the tree's clocks run while it is held, so a timer restored
/// with little time left fires before `--verify` looks (its signal pending
/// now and not in the image), and a pending signal of a POSIX timer was
/// seen gone once the timer was armed again at restore (pending in the
/// image, not now).
pub fn pending_signals(v: &[cr_image::model::SigInfo], timers: &[i32]) -> Vec<i32> {
    v.iter()
        .map(|s| s.signo() as i32)
        .filter(|s| !timers.contains(s))
        .collect()
}

/// The signals the armed timers of `p` send: to the whole process
/// (`thread` None: interval timers and SIGEV_SIGNAL POSIX timers), or to
/// thread `thread` (its TID in the process's PID namespace: SIGEV_THREAD_ID).
pub fn timer_signals(p: &Process, thread: Option<i32>) -> Vec<i32> {
    use cr_image::model::Notify;
    let mut out = Vec::new();
    if thread.is_none() {
        for t in &p.timers.itimers {
            out.push(match t.which {
                libc::ITIMER_REAL => libc::SIGALRM,
                libc::ITIMER_VIRTUAL => libc::SIGVTALRM,
                _ => libc::SIGPROF,
            });
        }
    }
    for t in p.timers.posix.iter().filter(|t| t.value_ns > 0) {
        match (t.notify, thread) {
            (Notify::Signal, None) => out.push(t.signo),
            (Notify::Thread(tid), Some(me)) if tid == me => out.push(t.signo),
            _ => {}
        }
    }
    out
}
