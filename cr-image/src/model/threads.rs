//! Section of kind "threads": per thread its registers, XSAVE area, rseq
//! registration, clear-child-tid address, parent-death signal, affinity,
//! timer slack, I/O priority and scheduling; and its
//! share of kind "signals" (mask, pending signals, alternate stack).

use super::seccomp::ThreadSeccomp;
use super::signals::{AltStack, SigInfo};
use super::task::Sched;
use super::{need, pb, ser, Bad, Process};
use serde::Serialize;

/// Largest XSAVE area accepted (CPUID 0xD reports a few KiB today).
pub const MAX_XSTATE: usize = 64 << 10;
/// The legacy area plus the XSAVE header: the smallest valid area.
pub const MIN_XSTATE: usize = 576;
/// CPU numbers of an affinity are below this (the kernel's largest
/// NR_CPUS).
pub const MAX_CPUS: u32 = 8192;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Thread {
    pub tid: u32,
    /// TID inside the process's own PID namespace.
    pub ns_tid: u32,
    pub regs: GpRegs,
    /// The whole NT_X86_XSTATE register set.
    #[serde(rename = "xstate_bytes", serialize_with = "ser::len")]
    pub xstate: Vec<u8>,
    pub rseq: Option<Rseq>,
    /// set_tid_address() of the thread.
    #[serde(serialize_with = "ser::hex")]
    pub clear_child_tid: u64,
    /// PR_SET_PDEATHSIG (0: none).
    pub pdeathsig: i32,
    /// set_robust_list(): head of the robust futex list and its size
    /// (0, 0: none).
    #[serde(serialize_with = "ser::hex")]
    pub robust_list: u64,
    pub robust_list_len: u64,
    /// sched_getaffinity(): the CPUs the thread may run on, ascending
    /// (empty: every CPU online at the checkpoint, not bound).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub affinity: Vec<u32>,
    #[serde(serialize_with = "ser::hex")]
    pub sigmask: u64,
    /// Signals pending for this thread only.
    pub pending: Vec<SigInfo>,
    pub sigaltstack: AltStack,
    /// kind "seccomp": its mode and filter chain.
    pub seccomp: ThreadSeccomp,
    /// Its name (PR_SET_NAME; empty: as its creator's).
    pub comm: String,
    /// PR_GET_TIMERSLACK, in ns (0: not known; a real-time thread has none).
    pub timer_slack_ns: u64,
    /// ioprio_get() of this thread (class << 13 | level; 0: never set;
    /// None: not in the image, the thread keeps the main thread's).
    pub ioprio: Option<u32>,
    /// Its own scheduling (policy, real-time priority, nice; None: not in
    /// the image, the thread keeps the main thread's).
    pub sched: Option<Sched>,
    /// kind "cgroups": the groups this thread is in that differ from its
    /// process's (cgroup v1 moves threads one by one; v2 threaded groups).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub cgroups: Vec<super::Cgroup>,
}

/// struct user_regs_struct (x86_64).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct GpRegs {
    pub r15: u64,
    pub r14: u64,
    pub r13: u64,
    pub r12: u64,
    pub rbp: u64,
    pub rbx: u64,
    pub r11: u64,
    pub r10: u64,
    pub r9: u64,
    pub r8: u64,
    pub rax: u64,
    pub rcx: u64,
    pub rdx: u64,
    pub rsi: u64,
    pub rdi: u64,
    pub orig_rax: u64,
    pub rip: u64,
    pub cs: u64,
    pub eflags: u64,
    pub rsp: u64,
    pub ss: u64,
    pub fs_base: u64,
    pub gs_base: u64,
    pub ds: u64,
    pub es: u64,
    pub fs: u64,
    pub gs: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Rseq {
    #[serde(serialize_with = "ser::hex")]
    pub addr: u64,
    pub len: u32,
    pub signature: u32,
}

macro_rules! regs_conv {
    ($($f:ident),*) => {
        fn regs_from_pb(r: pb::GpRegs) -> GpRegs {
            GpRegs { $($f: r.$f),* }
        }
        fn regs_to_pb(r: &GpRegs) -> pb::GpRegs {
            pb::GpRegs { $($f: r.$f),* }
        }
    };
}
regs_conv!(
    r15, r14, r13, r12, rbp, rbx, r11, r10, r9, r8, rax, rcx, rdx, rsi, rdi, orig_rax, rip, cs,
    eflags, rsp, ss, fs_base, gs_base, ds, es, fs, gs
);

impl Thread {
    pub(crate) fn from_pb(t: pb::Thread) -> Result<Thread, Bad> {
        Ok(Thread {
            tid: t.tid,
            ns_tid: t.ns_tid,
            regs: regs_from_pb(need(t.regs, "its registers")?),
            xstate: t.xstate,
            rseq: t.rseq.map(|r| Rseq {
                addr: r.addr,
                len: r.len,
                signature: r.signature,
            }),
            clear_child_tid: t.clear_child_tid,
            pdeathsig: t.pdeathsig,
            robust_list: t.robust_list,
            robust_list_len: t.robust_list_len,
            affinity: t.affinity,
            sigmask: t.sigmask,
            pending: t
                .pending
                .into_iter()
                .map(SigInfo::from_pb)
                .collect::<Result<_, _>>()?,
            sigaltstack: AltStack::from_pb(t.sigaltstack),
            seccomp: ThreadSeccomp::from_pb(t.seccomp_mode, t.seccomp_chain)?,
            comm: t.comm,
            timer_slack_ns: t.timer_slack_ns,
            ioprio: t.ioprio,
            sched: t.sched.map(Sched::from_pb).transpose()?,
            cgroups: super::cgroups::from_pb(t.cgroups)?,
        })
    }

    pub(crate) fn to_pb(&self) -> pb::Thread {
        pb::Thread {
            tid: self.tid,
            ns_tid: self.ns_tid,
            regs: Some(regs_to_pb(&self.regs)),
            xstate: self.xstate.clone(),
            rseq: self.rseq.map(|r| pb::Rseq {
                addr: r.addr,
                len: r.len,
                signature: r.signature,
            }),
            clear_child_tid: self.clear_child_tid,
            pdeathsig: self.pdeathsig,
            robust_list: self.robust_list,
            robust_list_len: self.robust_list_len,
            affinity: self.affinity.clone(),
            sigmask: self.sigmask,
            pending: self.pending.iter().map(|s| s.bytes().to_vec()).collect(),
            sigaltstack: Some(self.sigaltstack.to_pb()),
            seccomp_mode: self.seccomp.mode_pb(),
            seccomp_chain: self.seccomp.chain.clone(),
            comm: self.comm.clone(),
            timer_slack_ns: self.timer_slack_ns,
            ioprio: self.ioprio,
            sched: self.sched.map(Sched::to_pb),
            cgroups: self.cgroups.iter().map(super::Cgroup::to_pb).collect(),
        }
    }
}

pub(crate) fn validate(p: &Process) -> Result<(), Bad> {
    for t in &p.threads {
        let bad = |what: String| Err(format!("thread {}: {what}", t.tid));
        if !(MIN_XSTATE..=MAX_XSTATE).contains(&t.xstate.len()) {
            return bad(format!("an XSAVE area of {} bytes", t.xstate.len()));
        }
        if !(0..=64).contains(&t.pdeathsig) {
            return bad(format!("parent-death signal {}", t.pdeathsig));
        }
        if t.robust_list_len > 4096 {
            return bad(format!(
                "a robust futex list head of {} bytes",
                t.robust_list_len
            ));
        }
        if t.affinity.windows(2).any(|w| w[0] >= w[1])
            || t.affinity.last().is_some_and(|&c| c >= MAX_CPUS)
        {
            return bad(format!(
                "a CPU affinity not ascending or beyond CPU {MAX_CPUS}: {:?}",
                t.affinity
            ));
        }
        if let Some(prio) = t.ioprio {
            super::task::check_ioprio(prio).or_else(bad)?;
        }
        if let Some(r) = t.rseq {
            if r.len < 32 || r.len > 4096 || r.addr % 32 != 0 {
                return bad(format!("an rseq area of {} bytes at {:#x}", r.len, r.addr));
            }
        }
    }
    Ok(())
}
