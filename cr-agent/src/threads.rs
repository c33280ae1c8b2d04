//! Threads of a process: seizing all of them (until no new one appears)
//! and reading the state ptrace gives per thread.

use crate::CheckpointError;
use cr_image::proto;
use cr_sys::ptrace::{OnDrop, RseqConfig, Tracee};
use cr_sys::{proc, SysError};
use std::collections::BTreeSet;

/// Seize and stop every thread of `pid`; the main thread comes first.
///
/// A thread may create another while we seize the rest, so the thread list
/// is read again until it holds no thread we have not seized. Threads that
/// exit meanwhile are skipped.
pub fn seize_all(pid: i32) -> Result<Vec<Tracee>, CheckpointError> {
    let options = libc::PTRACE_O_TRACESYSGOOD as u64;
    let mut tracees: Vec<Tracee> = Vec::new();
    let mut seen = BTreeSet::new();
    loop {
        let tids = proc::list_tasks(pid).map_err(|e| CheckpointError::from_sys(pid, e))?;
        let mut new = false;
        for tid in tids {
            if !seen.insert(tid) {
                continue;
            }
            new = true;
            match Tracee::seize(tid, options, OnDrop::Detach) {
                Ok(t) => tracees.push(t),
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
        return Err(CheckpointError::Unsupported {
            pid,
            what: "process whose main thread has exited".into(),
        });
    }
    Ok(tracees)
}

/// Registers, XSAVE area, signal mask, pending signals and rseq of a stopped thread.
pub fn read(t: &Tracee) -> Result<proto::Thread, SysError> {
    let regs = t.get_regs()?;
    let rseq = t.get_rseq()?;
    let status = proc::Status::parse(&proc::read_string(&format!("/proc/{}/status", t.tid()))?);
    Ok(proto::Thread {
        tid: t.tid() as u32,
        regs: Some(crate::capture::gpregs_to_proto(&regs)),
        xstate: t.get_xstate()?,
        sigmask: t.get_sigmask()?,
        rseq: (rseq != RseqConfig::default()).then_some(proto::Rseq {
            addr: rseq.addr,
            len: rseq.len,
            signature: rseq.signature,
        }),
        pending: t.pending_signals(false)?,
        // Filled in by injected syscalls.
        clear_child_tid: 0,
        sigaltstack: None,
        pdeathsig: 0,
        ns_tid: status.ns_last("NSpid").unwrap_or(t.tid() as u32),
    })
}
