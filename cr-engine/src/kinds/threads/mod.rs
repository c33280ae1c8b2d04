//! Kind "threads": every thread of a process with its TID, registers (with
//! the syscall-restart fix-ups at restore), XSAVE area, rseq registration,
//! name, clear-child-tid address, parent-death signal, CPU affinity, timer
//! slack, I/O priority and scheduling (policy with SCHED_RESET_ON_FORK,
//! real-time priority, nice value). (A thread's signal state is kind
//! "signals".)
//!
//! Timer slack, I/O priority and scheduling are each thread's own (a worker
//! thread lowers its own I/O class or goes SCHED_BATCH or SCHED_IDLE, an
//! event loop widens its own slack, an audio thread is real-time). /proc has
//! timerslack_ns for the main thread only, so each thread is asked
//! (PR_GET_TIMERSLACK) and sets its own again (PR_SET_TIMERSLACK); the I/O
//! priority is read and set from outside by TID (ioprio_get/ioprio_set,
//! IOPRIO_WHO_PROCESS); so is the scheduling (sched_getattr and
//! getpriority, sched_setscheduler and setpriority, by TID: the nice value
//! is per thread on Linux). A new thread inherits them from the main
//! thread (kind "task" sets those first; SCHED_RESET_ON_FORK resets what
//! it inherits), then gets its own: its scheduling last, once nothing more
//! is injected into it (a SCHED_IDLE thread may hardly run on a busy
//! machine).
//!
//! CPU affinity: a thread bound to some CPUs (taskset, Open MPI's rank
//! binding, pthread_setaffinity_np) gets its set again, from the restorer
//! (sched_setaffinity on its TID); a thread that may run on every CPU
//! online at the checkpoint is not bound and keeps what the restore gives
//! it (the restorer's own affinity, a Slurm step's binding). An image bound
//! to a CPU this machine does not have online is refused before anything
//! is made ([`check_affinity`]): no silent fallback to other CPUs.
//!
//! Capture: [`seize_all`] stops every thread (reading the thread list again
//! until no new one appears); the registers come from ptrace, the rest
//! from injected system calls. Restore: the other threads are created with
//! clone3 `set_tid` from the main one and arrive stopped; each gets its
//! state, credentials, mask and registers; the main thread's registers are
//! set last of all.

mod regs;
#[cfg(test)]
mod tests;

pub use regs::{fix_syscall_restart, from_model, hide_stop_eintr, to_model};

use crate::capture::Proc;
use crate::error::{CheckpointError, RestoreError, StepContext};
use crate::kinds::seccomp::When;
use crate::kinds::{identity, seccomp, signals, Kind};
use crate::restore::Rebuild;
use crate::stub::Stub;
use cr_image::model::{AltStack, Checkpoint, Process, Rseq, Sched, Thread};
use cr_sys::clone::CloneError;
use cr_sys::ptrace::{OnDrop, RseqConfig, Tracee};
use cr_sys::remote::Injector;
use cr_sys::{proc, SysError};
use std::collections::BTreeSet;

pub struct Threads;

pub(crate) const PR_GET_TID_ADDRESS: u64 = 40;
const RSEQ_FLAG_UNREGISTER: u64 = 1;

/// Seize and stop every thread of `pid`; the main thread comes first.
///
/// A thread may create another while we seize the rest, so the thread list
/// is read again until it holds no thread we have not seized. Threads that
/// exit meanwhile are skipped.
///
/// Seized with PTRACE_O_SUSPEND_SECCOMP where the kernel allows it (it
/// needs CAP_SYS_ADMIN and a tracer without a filter of its own): a
/// program's seccomp filter would otherwise judge the system calls the
/// checkpoint injects, and one that refuses `prctl` (answering an errno of
/// its choice) or kills on it would fail the checkpoint or the program.
/// The filters act again once the threads are let go.
pub fn seize_all(pid: i32) -> Result<Vec<Tracee>, CheckpointError> {
    let options = libc::PTRACE_O_TRACESYSGOOD as u64;
    let mut suspend = true;
    let mut tracees: Vec<Tracee> = Vec::new();
    let mut seen = BTreeSet::new();
    loop {
        let tids = proc::tasks(pid).map_err(|e| CheckpointError::from_sys(pid, e))?;
        let mut new = false;
        for tid in tids {
            if !seen.insert(tid) {
                continue;
            }
            new = true;
            match Tracee::seize_past_seccomp(tid, options, OnDrop::Detach, &mut suspend) {
                Ok(t) => {
                    hide_our_stop(&t).map_err(|e| CheckpointError::from_sys(pid, e))?;
                    tracees.push(t)
                }
                Err(SysError::Ptrace { source, .. }) if source.0 == libc::ESRCH && tid != pid => {}
                Err(SysError::Exited { .. }) if tid != pid => {}
                Err(e) => return Err(CheckpointError::from_sys(pid, e)),
            }
        }
        if !new {
            break;
        }
    }
    tracees.sort_by_key(|t| (t.tid() != pid, t.tid()));
    if tracees.first().map(Tracee::tid) != Some(pid) {
        return Err(CheckpointError::unsupported(
            pid,
            "process whose main thread has exited",
        ));
    }
    Ok(tracees)
}

/// See [`hide_stop_eintr`]: done as soon as a thread stops, so that both
/// the image and the thread let go after the checkpoint restart the call.
fn hide_our_stop(t: &Tracee) -> Result<(), SysError> {
    let mut r = t.get_regs()?;
    if hide_stop_eintr(&mut r) {
        tracing::debug!(
            tid = t.tid(),
            nr = r.orig_rax,
            "system call interrupted by our stop will run again"
        );
        t.set_regs(&r)?;
    }
    Ok(())
}

impl Kind for Threads {
    const NAME: &'static str = "threads";

    fn capture(cx: &mut Proc<'_, '_>, p: &mut Process) -> Result<(), CheckpointError> {
        let pid = cx.pid;
        let sys = |e| CheckpointError::from_sys(pid, e);
        let online = cr_sys::sched::online_cpus().map_err(sys)?;
        for t in cx.probe.tracees() {
            let rseq = t.get_rseq().map_err(sys)?;
            let (robust_list, robust_list_len) = t.get_robust_list().map_err(sys)?;
            let st = proc::task_status(pid, t.tid()).map_err(sys)?;
            p.threads.push(Thread {
                tid: t.tid() as u32,
                ns_tid: proc::ns_last(&st.nspid).unwrap_or(t.tid() as u32),
                regs: to_model(&t.get_regs().map_err(sys)?),
                xstate: t.get_xstate().map_err(sys)?,
                rseq: (rseq != RseqConfig::default()).then_some(Rseq {
                    addr: rseq.addr,
                    len: rseq.len,
                    signature: rseq.signature,
                }),
                // Read below, with the alternate signal stack.
                clear_child_tid: 0,
                pdeathsig: 0,
                robust_list,
                robust_list_len,
                affinity: bound_cpus(cr_sys::sched::affinity(t.tid()).map_err(sys)?, &online),
                sigmask: 0,
                pending: Vec::new(),
                sigaltstack: AltStack::default(),
                // Read by kind "seccomp".
                seccomp: Default::default(),
                comm: st.name,
                // Read below.
                timer_slack_ns: 0,
                ioprio: Some(cr_sys::sched::io_priority(t.tid()).map_err(sys)?),
                sched: Some(sched(t.tid()).map_err(sys)?),
                // Read by kind "cgroups".
                cgroups: Vec::new(),
            });
        }
        let scratch = cx.probe.scratch().map_err(sys)?;
        // What only the thread can tell, in one stop of it (a batch): its
        // clear-child-tid address, parent-death signal and alternate
        // signal stack (kind "signals" keeps the latter). The main thread
        // was asked with the rest (`crate::asked`).
        let main = &cx.main;
        if let Some(th) = p.threads.first_mut() {
            th.clear_child_tid = main.clear_child_tid;
            th.pdeathsig = main.pdeathsig;
            th.sigaltstack = main.sigaltstack;
            th.timer_slack_ns = main.timer_slack_ns;
        }
        for (i, th) in p.threads.iter_mut().enumerate().skip(1) {
            let got = cx
                .probe
                .calls(
                    i,
                    &[
                        (
                            "prctl(PR_GET_TID_ADDRESS)",
                            libc::SYS_prctl,
                            [PR_GET_TID_ADDRESS, scratch, 0, 0, 0, 0],
                        ),
                        (
                            "prctl(PR_GET_PDEATHSIG)",
                            libc::SYS_prctl,
                            [libc::PR_GET_PDEATHSIG as u64, scratch + 8, 0, 0, 0, 0],
                        ),
                        (
                            "sigaltstack",
                            libc::SYS_sigaltstack,
                            [0, scratch + 16, 0, 0, 0, 0],
                        ),
                        // Answered as the return value (0 for a real-time
                        // thread).
                        (
                            "prctl(PR_GET_TIMERSLACK)",
                            libc::SYS_prctl,
                            [libc::PR_GET_TIMERSLACK as u64, 0, 0, 0, 0, 0],
                        ),
                    ],
                )
                .map_err(sys)?;
            let mut raw = [0u8; 40];
            cx.probe.read(0, &mut raw).map_err(sys)?;
            th.clear_child_tid = crate::probe::word(&raw, 0);
            th.pdeathsig = i32::from_le_bytes([raw[8], raw[9], raw[10], raw[11]]);
            th.sigaltstack = AltStack {
                sp: crate::probe::word(&raw, 2),
                flags: crate::probe::word(&raw, 3) as u32 as i32,
                size: crate::probe::word(&raw, 4),
            };
            th.timer_slack_ns = got[3];
        }
        Ok(())
    }

    /// The other threads, each complete (its registers set), and the main
    /// thread's own state (its registers come last, after every other kind).
    fn restore(cx: &mut Rebuild<'_, '_, '_>, p: &Process) -> Result<(), RestoreError> {
        let others = create(&mut cx.stub, &p.threads[1..], &cx.r.ids)?;
        // After they are made: a new thread inherits its creator's.
        set_affinity(cx.stub.pid(), &p.threads[0])?;
        for (t, th) in others.iter().zip(&p.threads[1..]) {
            set_affinity(t.tid(), th)?;
            set_io_priority(t.tid(), th)?;
            crate::kinds::cgroups::put_thread(cx, t.tid(), th)?;
        }
        let ip = cx.stub.inj.syscall_ip();
        let pid = cx.stub.pid();
        let args = cx.stub.thread_args();
        let scratch = cx.stub.scratch;
        let is_root = cx.is_root;
        let suspended = cx.r.ids.seccomp_suspended;
        let mut done = Vec::with_capacity(others.len());
        for (mut t, th) in others.into_iter().zip(&p.threads[1..]) {
            // A thread is made with its creator's name.
            let name = (!th.comm.is_empty() && th.comm != p.task.comm)
                .then(|| cx.stub.put_str(&th.comm))
                .transpose()?;
            let mut inj = Injector::new(&mut t, ip)?;
            thread_state(&mut inj, th)?;
            set_timer_slack(&mut inj, th)?;
            if let Some(name) = name {
                inj.call(
                    "prctl(PR_SET_NAME)",
                    libc::SYS_prctl,
                    [libc::PR_SET_NAME as u64, name, 0, 0, 0, 0],
                )
                .step(|| format!("cannot name thread {} {:?}", th.tid, th.comm))?;
            }
            signals::restore_thread(&mut inj, pid, args, th)?;
            let ids = (cx.r.ids.inner(p.pid), cx.r.ids.inner_tid(th));
            signals::queue_thread_pending(&mut inj, pid, ids, args, th)?;
            let room = (scratch, crate::stub::SCRATCH);
            seccomp::restore_thread(&mut inj, p, th, room, When::BeforeCreds, suspended)?;
            identity::set_creds(&mut inj, args, th.tid, &p.identity.creds)?;
            // After the credentials: changing them clears it.
            set_pdeathsig(&mut inj, th, is_root)?;
            seccomp::restore_thread(&mut inj, p, th, room, When::Last, suspended)?;
            inj.finish_with_mask(th.sigmask)?;
            set_registers(&t, th)?;
            set_scheduling(t.tid(), th)?;
            done.push(t);
        }
        cx.threads = done;
        let main = &p.threads[0];
        main_thread_state(&mut cx.stub, main)?;
        signals::restore_thread(&mut cx.stub.inj, pid, args, main)
    }
}

/// Refuse a CPU lacking a feature the image's XSAVE areas use (`stub`'s
/// XSAVE area tells what this CPU has).
pub fn check_cpu(ck: &Checkpoint, stub: &Tracee) -> Result<(), RestoreError> {
    let here = cr_sys::regs::xstate_xfeatures(&stub.get_xstate()?).unwrap_or(0);
    let missing = ck.meta.cpu_xfeatures & !here;
    if missing != 0 {
        return Err(RestoreError::CpuFeatures { missing });
    }
    Ok(())
}

/// The CPUs of a thread's affinity, as the image keeps them: none when it
/// covers every CPU online (the thread is not bound).
fn bound_cpus(cpus: Vec<u32>, online: &[u32]) -> Vec<u32> {
    if online.iter().all(|c| cpus.binary_search(c).is_ok()) {
        Vec::new()
    } else {
        cpus
    }
}

/// Refuse an image with a thread bound to CPUs not online here (`online`,
/// ascending), naming the thread and the CPUs: binding it elsewhere would
/// silently change where it runs (and what it shares a cache with).
pub fn check_affinity(procs: &[Process], online: &[u32]) -> Result<(), RestoreError> {
    for p in procs {
        for t in &p.threads {
            let missing: Vec<u32> = t
                .affinity
                .iter()
                .copied()
                .filter(|c| online.binary_search(c).is_err())
                .collect();
            if !missing.is_empty() {
                return Err(RestoreError::Affinity {
                    pid: p.pid,
                    tid: t.tid,
                    cpus: cr_sys::sched::cpu_list(&t.affinity),
                    missing: cr_sys::sched::cpu_list(&missing),
                    online: cr_sys::sched::cpu_list(online),
                });
            }
        }
    }
    Ok(())
}

/// Bind thread `tid` (ours: outside any PID namespace of the image) as
/// `th` was; an unbound thread is left alone.
fn set_affinity(tid: i32, th: &Thread) -> Result<(), RestoreError> {
    if th.affinity.is_empty() {
        return Ok(());
    }
    cr_sys::sched::set_affinity(tid, &th.affinity).step(|| {
        format!(
            "cannot bind thread {} to CPUs {} (outside this cgroup's cpuset?)",
            th.tid,
            cr_sys::sched::cpu_list(&th.affinity)
        )
    })
}

/// The I/O priority of thread `tid` (ours) as `th` had it, 0 (never set)
/// included: a new thread inherits the main thread's.
fn set_io_priority(tid: i32, th: &Thread) -> Result<(), RestoreError> {
    let Some(prio) = th.ioprio else {
        return Ok(());
    };
    cr_sys::sched::set_io_priority(tid, prio)
        .step(|| format!("cannot set I/O priority {prio:#x} of thread {}", th.tid))
}

/// The scheduling of thread `tid` (policy, real-time priority, nice).
fn sched(tid: i32) -> Result<Sched, SysError> {
    let (policy, priority, nice) = cr_sys::sched::scheduling(tid)?;
    Ok(Sched {
        policy,
        priority,
        nice,
    })
}

/// The scheduling of thread `tid` (ours) as `th` had it: a new thread
/// inherits the main thread's.
fn set_scheduling(tid: i32, th: &Thread) -> Result<(), RestoreError> {
    let Some(s) = th.sched else {
        return Ok(());
    };
    cr_sys::sched::set_scheduling(tid, s.policy, s.priority, s.nice).step(|| {
        format!(
            "cannot set scheduling policy {:#x} priority {} nice {} of thread {}",
            s.policy, s.priority, s.nice, th.tid
        )
    })
}

/// The thread's own timer slack, set by itself (the kernel offers no other
/// way for a thread but the main one). 0: not known, or a real-time thread
/// (which has none: the kernel ignores the call).
fn set_timer_slack(inj: &mut Injector<'_>, th: &Thread) -> Result<(), RestoreError> {
    if th.timer_slack_ns == 0 {
        return Ok(());
    }
    inj.call(
        "prctl(PR_SET_TIMERSLACK)",
        libc::SYS_prctl,
        [
            libc::PR_SET_TIMERSLACK as u64,
            th.timer_slack_ns,
            0,
            0,
            0,
            0,
        ],
    )
    .step(|| {
        format!(
            "cannot set timer slack {} ns of thread {}",
            th.timer_slack_ns, th.tid
        )
    })?;
    Ok(())
}

/// Our glibc registered rseq for the stub; the kernel would write to that
/// area (about to be unmapped) on every preemption.
pub fn drop_stub_rseq(stub: &mut Stub<'_>, own: &RseqConfig) -> Result<(), RestoreError> {
    if own.addr == 0 {
        return Ok(());
    }
    stub.call(
        "rseq",
        libc::SYS_rseq,
        [
            own.addr,
            own.len as u64,
            RSEQ_FLAG_UNREGISTER,
            own.signature as u64,
            0,
            0,
        ],
    )
    .step(|| "cannot unregister the stub's rseq area".into())?;
    Ok(())
}

/// Create the threads after the main one, each with its TID; they arrive
/// stopped (PTRACE_O_TRACECLONE) and never run before the release.
fn create(
    stub: &mut Stub<'_>,
    threads: &[Thread],
    ids: &crate::kinds::tree::restore::Ids,
) -> Result<Vec<Tracee>, RestoreError> {
    let flags = (libc::CLONE_VM
        | libc::CLONE_FS
        | libc::CLONE_FILES
        | libc::CLONE_SIGHAND
        | libc::CLONE_THREAD
        | libc::CLONE_SYSVSEM) as u64;
    let mut out = Vec::with_capacity(threads.len());
    for th in threads {
        let tid = ids.inner_tid(th) as i32;
        if !ids.pidns && cr_sys::clone::pid_exists(tid) {
            return Err(CloneError::PidInUse(tid).into());
        }
        let tids = stub.put(&tid.to_le_bytes())?;
        // struct clone_args: flags, pidfd, child_tid, parent_tid, exit_signal,
        // stack, stack_size, tls, set_tid, set_tid_size, cgroup.
        let fields = [flags, 0, 0, 0, 0, 0, 0, 0, tids, 1, 0];
        let bytes: Vec<u8> = fields.iter().flat_map(|v| v.to_le_bytes()).collect();
        let args = stub.put(&bytes)?;
        let got = stub
            .call(
                "clone3",
                libc::SYS_clone3,
                [args, bytes.len() as u64, 0, 0, 0, 0],
            )
            .step(|| format!("cannot create thread {tid}"))?;
        // Inside a new PID namespace clone3 answers the inner TID; ptrace told
        // us ours (never use the inner one here: it names another task).
        let outer = stub.inj.take_new_task().ok_or_else(|| {
            RestoreError::Unsupported(format!("no clone event for thread {tid} ({got})"))
        })?;
        out.push(Tracee::attach_new(outer, OnDrop::Kill)?);
    }
    Ok(out)
}

/// The thread's parent-death signal. Set after its credentials: the
/// kernel clears it whenever they change (commit_creds).
pub fn set_pdeathsig(
    inj: &mut Injector<'_>,
    th: &Thread,
    is_root: bool,
) -> Result<(), RestoreError> {
    // The root's parent is now the restorer, which may exit at once
    // (--detach): its parent-death signal would fire, so it is not restored.
    let pdeathsig = if is_root { 0 } else { th.pdeathsig };
    inj.call(
        "prctl(PR_SET_PDEATHSIG)",
        libc::SYS_prctl,
        [libc::PR_SET_PDEATHSIG as u64, pdeathsig as u64, 0, 0, 0, 0],
    )
    .step(|| format!("cannot set the parent-death signal of thread {}", th.tid))?;
    Ok(())
}

/// sizeof(struct robust_list_head), the only size set_robust_list takes.
const ROBUST_LIST_HEAD: u64 = 24;

/// Per-thread state only the thread itself can set: clear-child-tid
/// address, robust futex list, rseq area.
fn thread_state(inj: &mut Injector<'_>, th: &Thread) -> Result<(), RestoreError> {
    let tid = th.tid;
    inj.call(
        "set_tid_address",
        libc::SYS_set_tid_address,
        [th.clear_child_tid, 0, 0, 0, 0, 0],
    )?;
    // Always set: the stub's own glibc registered a list of its own, in
    // memory the image replaces (the kernel would walk it at exit).
    inj.call(
        "set_robust_list",
        libc::SYS_set_robust_list,
        [
            th.robust_list,
            if th.robust_list_len == 0 {
                ROBUST_LIST_HEAD
            } else {
                th.robust_list_len
            },
            0,
            0,
            0,
            0,
        ],
    )
    .step(|| format!("cannot set the robust futex list of thread {tid}"))?;
    if let Some(r) = &th.rseq {
        inj.call(
            "rseq",
            libc::SYS_rseq,
            [r.addr, r.len as u64, 0, r.signature as u64, 0, 0],
        )
        .step(|| format!("cannot register rseq at {:#x} for thread {tid}", r.addr))?;
    }
    Ok(())
}

/// [`thread_state`] of the main thread, whose stub runs batches: queued
/// and run in one stop (three calls, six stops, on the main tracer
/// thread for every process before).
fn main_thread_state(stub: &mut crate::stub::Stub<'_>, th: &Thread) -> Result<(), RestoreError> {
    let tid = th.tid;
    stub.later(
        "set_tid_address",
        libc::SYS_set_tid_address,
        [th.clear_child_tid, 0, 0, 0, 0, 0],
        format!("cannot set the clear-child-tid address of thread {tid}"),
    )?;
    // Always set, as in `thread_state`.
    let len = if th.robust_list_len == 0 {
        ROBUST_LIST_HEAD
    } else {
        th.robust_list_len
    };
    stub.later(
        "set_robust_list",
        libc::SYS_set_robust_list,
        [th.robust_list, len, 0, 0, 0, 0],
        format!("cannot set the robust futex list of thread {tid}"),
    )?;
    if let Some(r) = &th.rseq {
        stub.later(
            "rseq",
            libc::SYS_rseq,
            [r.addr, r.len as u64, 0, r.signature as u64, 0, 0],
            format!("cannot register rseq at {:#x} for thread {tid}", r.addr),
        )?;
    }
    stub.flush()?;
    Ok(())
}

/// Registers (with the syscall-restart fix-ups) and XSAVE area of a thread.
pub fn set_registers(t: &Tracee, th: &Thread) -> Result<(), RestoreError> {
    let mut r = from_model(&th.regs);
    fix_syscall_restart(&mut r);
    t.set_regs(&r)?;
    t.set_xstate(&th.xstate)?;
    Ok(())
}

/// `--verify`: every thread with its ids, registers (after the restart
/// fix-ups a restore makes), FPU/SSE state, rseq, robust list, clear-child-tid,
/// parent-death signal, CPU affinity (a restored thread only when it was
/// bound), timer slack (when known), I/O priority and scheduling (when in
/// the image), and its share of kind "signals" (mask, pending
/// signals, alternate stack) and of kind "seccomp" (mode, filters).
pub fn verify(c: &mut crate::verify::Compare<'_>, image: &Process, now: &Process) {
    let pidns = c.pidns;
    let tid = move |t: &Thread| if pidns { t.ns_tid } else { t.tid };
    let (ta, tb): (Vec<u32>, Vec<u32>) = (
        image.threads.iter().map(tid).collect(),
        now.threads.iter().map(tid).collect(),
    );
    if !c.same("threads", "thread ids", &ta, &tb) {
        return;
    }
    for (a, b) in image.threads.iter().zip(&now.threads) {
        let what = format!("thread {}", tid(a));
        let mut regs = from_model(&a.regs);
        if c.restored {
            fix_syscall_restart(&mut regs);
        }
        c.same(&what, "registers", &to_model(&regs), &b.regs);
        // The legacy area (x87, MXCSR, XMM registers): the rest of an XSAVE
        // area may legitimately come back in another (compacted or init)
        // form.
        let legacy = |x: &[u8]| x.get(..416).map(<[u8]>::to_vec);
        c.same(
            &what,
            "FPU and SSE registers",
            &legacy(&a.xstate),
            &legacy(&b.xstate),
        );
        if !a.comm.is_empty() {
            c.same(&what, "name", &a.comm, &b.comm);
        }
        c.same(&what, "rseq", &a.rseq, &b.rseq);
        c.same(
            &what,
            "robust futex list",
            &(a.robust_list, a.robust_list_len),
            &(b.robust_list, b.robust_list_len),
        );
        c.same(
            &what,
            "clear-child-tid address",
            &a.clear_child_tid,
            &b.clear_child_tid,
        );
        // Not the restored root's: its parent is the restorer (see
        // `thread_state`).
        if !(c.restored && c.root) {
            c.same(&what, "parent-death signal", &a.pdeathsig, &b.pdeathsig);
        }
        // A restored unbound thread runs where the restore put it.
        if !(c.restored && a.affinity.is_empty()) {
            c.same(&what, "CPU affinity", &a.affinity, &b.affinity);
        }
        if a.timer_slack_ns != 0 {
            c.same(&what, "timer slack", &a.timer_slack_ns, &b.timer_slack_ns);
        }
        if a.ioprio.is_some() {
            c.same(&what, "I/O priority", &a.ioprio, &b.ioprio);
        }
        if a.sched.is_some() {
            c.same(&what, "scheduling", &a.sched, &b.sched);
        }
        c.same(&what, "signal mask", &a.sigmask, &b.sigmask);
        let fired = signals::timer_signals(image, Some(a.ns_tid as i32));
        c.same(
            &what,
            "pending signals",
            &signals::pending_signals(&a.pending, &fired),
            &signals::pending_signals(&b.pending, &fired),
        );
        c.same(
            &what,
            "alternate signal stack",
            &a.sigaltstack,
            &b.sigaltstack,
        );
        c.same(&what, "seccomp", &a.seccomp, &b.seccomp);
    }
    c.same(
        "seccomp",
        "filters",
        &image.seccomp_filters,
        &now.seccomp_filters,
    );
}
