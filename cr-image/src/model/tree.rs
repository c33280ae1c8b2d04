//! Section of kind "tree": where a process stands in the tree (its ids,
//! parent, group, session, inside and outside its PID namespace) and its
//! state (running, stopped by job control, or a zombie not yet reaped).

use super::{pb, Bad, Checkpoint};
use serde::Serialize;
use std::collections::HashSet;

/// What a process was doing, as far as the tree is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum ProcState {
    #[default]
    Running,
    /// In a job-control stop: restored stopped, by this signal (SIGSTOP,
    /// SIGTSTP, SIGTTIN or SIGTTOU) when it can be delivered again.
    Stopped { signal: i32 },
    /// Exited, not yet reaped: restored as a zombie with this wait status.
    Zombie { exit_status: i32 },
}

/// Signal numbers (x86_64) of the job-control stops and of SIGCHLD.
pub const SIGCHLD: i32 = 17;
pub const SIGSTOP: i32 = 19;
pub const SIGTSTP: i32 = 20;
pub const SIGTTIN: i32 = 21;
pub const SIGTTOU: i32 = 22;

pub(crate) fn state_from_pb(s: Option<pb::process::State>) -> Result<ProcState, Bad> {
    use pb::process::State;
    match s {
        Some(State::Running(_)) => Ok(ProcState::Running),
        Some(State::Stopped(s)) => match s.signal {
            0 => Ok(ProcState::Stopped { signal: SIGSTOP }),
            signal @ (SIGSTOP | SIGTSTP | SIGTTIN | SIGTTOU) => Ok(ProcState::Stopped { signal }),
            s => Err(format!("stopped by signal {s}, not a job-control stop")),
        },
        Some(State::Zombie(z)) => Ok(ProcState::Zombie {
            exit_status: z.exit_status,
        }),
        None => Err("its state is of a kind this build does not know".into()),
    }
}

pub(crate) fn state_to_pb(s: ProcState) -> pb::process::State {
    use pb::process::State;
    match s {
        ProcState::Running => State::Running(pb::Running {}),
        ProcState::Stopped { signal } => State::Stopped(pb::Stopped { signal }),
        ProcState::Zombie { exit_status } => State::Zombie(pb::Zombie { exit_status }),
    }
}

/// The tree's shape: unique ids, the root first, every parent before its
/// children, threads only in live processes, ids inside a PID namespace.
pub(crate) fn validate(ck: &Checkpoint) -> Result<(), Bad> {
    let procs = &ck.processes;
    let root = procs.first().ok_or("the image holds no process")?;
    if root.pid != ck.root_pid || root.is_zombie() {
        return Err(format!(
            "the first process ({}) is not the live root {}",
            root.pid, ck.root_pid
        ));
    }
    let mut pids = HashSet::new();
    let mut tids = HashSet::new();
    let mut inner = HashSet::new();
    for (i, p) in procs.iter().enumerate() {
        let bad = |what: String| Err(format!("process {}: {what}", p.pid));
        if p.pid == 0 || p.pid > i32::MAX as u32 {
            return bad("bad pid".into());
        }
        if i > 0 && !pids.contains(&p.ppid) {
            return bad(format!("its parent {} is not listed before it", p.ppid));
        }
        if !pids.insert(p.pid) {
            return bad("listed twice".into());
        }
        if ck.pidns {
            if p.ns_pid == 0 || p.ns_pid > i32::MAX as u32 || !inner.insert(p.ns_pid) {
                return bad(format!("bad id {} in its PID namespace", p.ns_pid));
            }
            if i == 0 && p.ns_pid != 1 {
                return bad("the root of a PID namespace is not its PID 1".into());
            }
        }
        if p.is_zombie() {
            if !p.threads.is_empty() || !p.vmas.is_empty() || !p.fds.is_empty() {
                return bad("a zombie with threads, memory or fds".into());
            }
            continue;
        }
        // A pre-dump holds memory only.
        match p.threads.first() {
            Some(t) if t.tid == p.pid => {}
            None if ck.pre_dump => {}
            _ => return bad("its first thread is not the main thread".into()),
        }
        for t in &p.threads {
            if t.tid == 0 || t.tid > i32::MAX as u32 {
                return bad(format!("bad thread id {}", t.tid));
            }
            if !tids.insert(t.tid) {
                return bad(format!("thread {} is listed twice", t.tid));
            }
            if ck.pidns && (t.ns_tid == 0 || t.ns_tid > i32::MAX as u32) {
                return bad(format!("thread {} has no id in its PID namespace", t.tid));
            }
        }
    }
    shared_tables(procs)?;
    // A thread id is never also the id of another process.
    for p in procs {
        if let Some(t) = p.threads.iter().skip(1).find(|t| pids.contains(&t.tid)) {
            return Err(format!(
                "process {}: thread {} is also a process",
                p.pid, t.tid
            ));
        }
    }
    Ok(())
}

/// What a process shares with another (`fd_table_of`, `fs_of`) names a
/// live process listed before it that holds its own; a process sharing
/// another's fd table lists no fd of its own.
fn shared_tables(procs: &[super::Process]) -> Result<(), Bad> {
    for (i, p) in procs.iter().enumerate() {
        let owner_of = |of: &dyn Fn(&super::Process) -> Option<u32>, what: &str| {
            let Some(o) = of(p) else {
                return Ok(());
            };
            match procs[..i].iter().find(|q| q.pid == o) {
                Some(q) if !q.is_zombie() && !p.is_zombie() && of(q).is_none() => Ok(()),
                _ => Err(format!(
                    "process {}: shares the {what} of {o}, not a live process listed before it with its own",
                    p.pid
                )),
            }
        };
        owner_of(&|q| q.fd_table_of, "fd table")?;
        owner_of(&|q| q.fs_of, "working directory and umask")?;
        if p.fd_table_of.is_some() && !p.fds.is_empty() {
            return Err(format!(
                "process {}: shares the fd table of {} and lists fds of its own",
                p.pid,
                p.fd_table_of.unwrap_or(0)
            ));
        }
    }
    Ok(())
}
