//! Kind "tree": the processes of the tree and how they hang together —
//! parent links, process groups, sessions, ids inside a PID namespace,
//! job-control stops and zombies.
//!
//! Capture: [`walk`] lists the tree, [`freeze`] seizes it top-down (a
//! frozen process cannot fork, so children that appear meanwhile are found
//! when their frozen parent is read), [`ids`] fills a process's section,
//! [`let_go`] lets the tree run on, stop or die. Restore ([`restore`]):
//! stubs with the saved PIDs, each forked by its parent's stub, sessions
//! and groups, zombies.

pub mod restore;
#[cfg(test)]
mod tests;

use crate::error::CheckpointError;
use crate::kinds::threads;
use crate::options::Action;
use cr_image::model::{ProcState, Process};
use cr_sys::proc::{self, Stat, Status};
use cr_sys::ptrace::Tracee;
use std::collections::{BTreeSet, HashMap, VecDeque};

/// A process of the tree, frozen (or a zombie, which needs no freezing).
pub struct Frozen {
    pub pid: i32,
    /// Every thread, main first; empty for a zombie.
    pub tracees: Vec<Tracee>,
    /// Was in a job-control stop before we came, by this signal.
    pub stopped: Option<i32>,
    /// Wait status of a zombie not yet reaped.
    pub zombie: Option<i32>,
}

/// Check that `pid` names a user process this build can capture, before
/// anything is frozen.
pub fn validate(pid: i32) -> Result<(), CheckpointError> {
    if pid <= 0 || !std::path::Path::new(&format!("/proc/{pid}")).exists() {
        return Err(CheckpointError::NoSuchProcess(pid));
    }
    if pid == std::process::id() as i32 {
        return Err(CheckpointError::SelfCheckpoint);
    }
    let stat = proc::stat(pid).map_err(|_| CheckpointError::NoSuchProcess(pid))?;
    if stat.flags & proc::PF_KTHREAD != 0 {
        return Err(CheckpointError::KernelThread(pid));
    }
    let status = proc::status(pid).map_err(|_| CheckpointError::NoSuchProcess(pid))?;
    if status.tgid != pid {
        return Err(CheckpointError::NotAProcess {
            tid: pid,
            tgid: status.tgid,
        });
    }
    if stat.state == 'Z' || stat.state == 'X' {
        dead_leader(pid)?;
        return Err(CheckpointError::Zombie(pid));
    }
    Ok(())
}

/// A process waiting in vfork() for its child, which shares its memory
/// (CLONE_VM) until it calls exec or exits: refused by name, at once. The
/// kernel wakes the parent there for nothing but a fatal signal (a freeze
/// would wait for its stop in vain, and its registers are out of reach),
/// and the two could not get one memory again. Asked before anything is
/// stopped, and again right before the process is seized.
pub fn vfork_wait(pid: i32) -> Result<(), CheckpointError> {
    use cr_sys::mem::{shares, Shared};
    for c in proc::children(pid).unwrap_or_default() {
        if shares(c, pid, Shared::Vm).unwrap_or(false) {
            return Err(CheckpointError::unsupported(
                pid,
                format!("a process waiting in vfork() for its child {c}, which shares its memory until it calls exec or exits (the parent cannot be stopped there)"),
            ));
        }
    }
    Ok(())
}

/// A process shown as a zombie ('Z') whose other threads still run: its
/// main thread exited alone (pthread_exit in main), and the process lives
/// on. Refused by name: it cannot be stopped through its main thread, and
/// a restore would have to end that thread again once the others run.
pub fn dead_leader(pid: i32) -> Result<(), CheckpointError> {
    if proc::tasks(pid).is_ok_and(|t| t.len() > 1) {
        return Err(CheckpointError::unsupported(
            pid,
            "a process whose main thread has exited (pthread_exit) while its other threads run",
        ));
    }
    Ok(())
}

/// A process of the tree for [`early_children`]: its PID, its parent's,
/// its session id, whether it is a zombie (which makes no session and
/// forks nothing at a restore), and the signal it sends its parent when
/// it exits.
#[derive(Debug, Clone, Copy)]
pub struct InSession {
    pub pid: u32,
    pub ppid: u32,
    pub sid: u32,
    pub zombie: bool,
    pub exit_signal: i32,
}

/// What [`early_children`] plans for a restore.
#[derive(Debug, Default)]
pub struct SessionPlan {
    /// The processes to fork before their parent's setsid.
    pub early: BTreeSet<u32>,
    /// Sessions whose leader is gone, each had from a helper.
    pub helpers: Vec<SessionHelper>,
}

/// A session whose leader is gone (it made the session, forked, and
/// exited: zdtm `session02`, a daemon's double fork under a subreaper).
/// At a restore the stub of `parent` forks a helper with the session's
/// id as its PID (the kernel never reuses a number a session still has,
/// so it is free where the image's processes were), which calls setsid
/// and forks `children` (children of `parent` in the session) with
/// CLONE_PARENT, then exits and is reaped. Their descendants inherit the
/// session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionHelper {
    pub sid: u32,
    pub parent: u32,
    pub children: Vec<u32>,
}

/// How a restore gives every process its session back, or why it cannot.
///
/// A session is inherited at fork and made only by setsid(2), which makes
/// the caller the leader of a new one named by its own PID. A restore
/// forks each process from its parent's stub ([`restore::spawn`]), and a
/// session leader's stub calls setsid before it forks its children, who
/// are then in its session. A process in a session other than its
/// parent's, not its own, was forked before its parent made its own
/// session (`fork(); setsid()` in the parent: zdtm's `session00`), or
/// descends from such a child, or is in a session whose leader is gone
/// (no process of the tree has its number: [`SessionHelper`]). A process
/// of the first kind is forked *before* its parent's setsid, in the
/// session the parent was born in; that parent must itself be born in
/// that session, and so on up to the leader that made it.
///
/// `procs` are the tree's processes, parents before children (the root
/// first). Answers the PIDs of the processes to fork before their
/// parent's setsid and the helpers; refused with the process and why: a
/// child in a session its parent was never in whose leader is in the tree
/// but no ancestor (reparented) or a zombie, children of one leader in
/// two sessions other than its own, children of two parents in one
/// session whose leader is gone, or children of one parent in such a
/// session with exit signals other than SIGCHLD.
pub fn early_children(procs: &[InSession]) -> Result<SessionPlan, (u32, String)> {
    let by_pid: HashMap<u32, &InSession> = procs.iter().map(|p| (p.pid, p)).collect();
    let leader = |p: &InSession| p.sid == p.pid && !p.zombie;
    // In a session whose leader is not in the tree, which none of its
    // ancestors is in (the root's session, or one inherited from an
    // ancestor, is had through the ancestors): had from a helper.
    let root = procs.first().map(|r| r.pid);
    let from_helper = |c: &InSession| {
        if c.zombie || Some(c.pid) == root || by_pid.contains_key(&c.sid) {
            return false;
        }
        let mut up = by_pid.get(&c.ppid);
        for _ in 0..procs.len() {
            let Some(q) = up else { break };
            if q.sid == c.sid {
                return false;
            }
            if Some(q.pid) == root {
                break;
            }
            up = by_pid.get(&q.ppid);
        }
        true
    };
    // The session each process must be born in (None: any), children first.
    let mut born_in: HashMap<u32, Option<u32>> = HashMap::new();
    for p in procs.iter().rev() {
        let need = if p.zombie {
            None
        } else if !leader(p) {
            Some(p.sid)
        } else {
            let mut need = None;
            for c in procs
                .iter()
                .filter(|c| c.ppid == p.pid && c.pid != p.pid && !from_helper(c))
            {
                let Some(s) = born_in.get(&c.pid).copied().flatten() else {
                    continue;
                };
                match need {
                    _ if s == p.pid => {}
                    None => need = Some(s),
                    Some(other) if other == s => {}
                    Some(other) => {
                        return Err((
                            p.pid,
                            format!(
                                "a session leader whose children are in two sessions other than its own ({other} and {s}; one of them could not be had from it at a restore)"
                            ),
                        ))
                    }
                }
            }
            need
        };
        born_in.insert(p.pid, need);
    }
    let mut plan = SessionPlan::default();
    for (i, p) in procs.iter().enumerate() {
        let Some(s) = born_in[&p.pid] else {
            continue;
        };
        let parent = by_pid.get(&p.ppid).filter(|_| i > 0);
        let Some(q) = parent else {
            // The root: forked by the restorer, in its session, unless it
            // makes its own (what `restore::spawn` is given handles the rest).
            if leader(p) {
                return Err((
                    p.pid,
                    format!(
                        "the root of the tree, a session leader whose children were forked in session {s}, which it left (it is outside the tree)"
                    ),
                ));
            }
            continue;
        };
        if s == q.sid {
            continue;
        }
        if leader(q) && born_in[&q.pid] == Some(s) {
            plan.early.insert(p.pid);
            continue;
        }
        if from_helper(p) {
            if p.exit_signal != libc::SIGCHLD {
                return Err((
                    p.pid,
                    format!(
                        "a process in session {s}, whose leader is gone, with exit signal {} (the helper that gives it the session at a restore forks it with CLONE_PARENT: SIGCHLD only)",
                        p.exit_signal
                    ),
                ));
            }
            match plan.helpers.iter_mut().find(|h| h.sid == s) {
                None => plan.helpers.push(SessionHelper {
                    sid: s,
                    parent: q.pid,
                    children: vec![p.pid],
                }),
                Some(h) if h.parent == q.pid => h.children.push(p.pid),
                Some(h) => {
                    return Err((
                        p.pid,
                        format!(
                            "a process in session {s}, whose leader is gone, as are children of another parent ({}, and its parent {}): a restore makes that session once, for the children of one parent",
                            h.parent, q.pid
                        ),
                    ))
                }
            }
            continue;
        }
        let why = match by_pid.get(&s) {
            Some(l) if l.zombie => format!("its leader {s} is a zombie of the tree"),
            Some(_) => {
                format!("its leader {s} is in the tree but no ancestor: the process was reparented")
            }
            None => "the session's leader exited".into(),
        };
        return Err((
            p.pid,
            format!(
                "a process in session {s}, other than its parent {}'s ({}), that it could not get from its parent at a restore ({why})",
                q.pid, q.sid
            ),
        ));
    }
    Ok(plan)
}

/// The sessions `plan` has made again by a helper are those whose leader
/// is gone: one whose leader is alive outside the tree (a child that kept
/// the shell's session when the root made its own) is refused by name,
/// since a restore could not have the leader's PID for its helper.
pub fn helpers_possible(plan: &SessionPlan) -> Result<(), CheckpointError> {
    for h in &plan.helpers {
        if h.sid == 0 {
            // getsid() and /proc's stat say 0 for a session whose leader
            // is in an ancestor PID namespace: no PID here to give a helper.
            return Err(CheckpointError::unsupported(
                h.children.first().copied().unwrap_or(h.parent) as i32,
                format!(
                    "a process in a session other than its parent {}'s, whose leader is outside the PID namespace (session 0): a restore could not make that session again",
                    h.parent
                ),
            ));
        }
        let Some(leader) = proc::pid_holder(h.sid as i32).filter(|l| !l.zombie && !l.exiting)
        else {
            continue;
        };
        return Err(CheckpointError::unsupported(
            h.children.first().copied().unwrap_or(h.parent) as i32,
            format!(
                "a process in session {}, other than its parent {}'s, whose leader is alive outside the tree (`{}`): a restore could not make that session again",
                h.sid, h.parent, leader.comm
            ),
        ));
    }
    Ok(())
}

/// The fd tables and the fs information (working directory, root, umask)
/// of the tree's processes met so far, in tree order (parents first): the
/// first process of each is its owner, which holds it in the image; the
/// others share it (clone with CLONE_FILES or CLONE_FS, not CLONE_VM) and
/// name their owner (`Process::fd_table_of`, `Process::fs_of`). A restore
/// shares a table again by creating the process with CLONE_FILES (or
/// CLONE_FS) from its parent: a process sharing a table its parent does
/// not share is refused by name.
#[derive(Default)]
pub struct Tables {
    owners: [Vec<i32>; 2],
    /// Process -> owner of its fd table and of its fs information.
    of: HashMap<i32, [i32; 2]>,
}

impl Tables {
    /// Process `pid`, child of `ppid`, next in tree order: the owners of
    /// its fd table and of its fs information when it shares them with a
    /// process met before it.
    pub fn add(&mut self, pid: i32, ppid: i32) -> Result<[Option<i32>; 2], CheckpointError> {
        self.add_among(pid, ppid, false)
    }

    /// [`Tables::add`], comparing `pid` with every owner met so far, or
    /// (`parent_only`) with its parent's owners alone: what the capture of
    /// a frozen tree does, once the pre-flight compared every pair (a
    /// process cannot start sharing another's table since: only a clone
    /// shares one, with the parent) — one kcmp per process and kind while
    /// frozen, not one per pair.
    fn add_among(
        &mut self,
        pid: i32,
        ppid: i32,
        parent_only: bool,
    ) -> Result<[Option<i32>; 2], CheckpointError> {
        use cr_sys::mem::{shares, Shared};
        let mut out = [None; 2];
        let mut mine = [pid; 2];
        for (k, (what, name)) in [
            (Shared::FdTable, "file descriptor table (CLONE_FILES)"),
            (
                Shared::FsInfo,
                "working directory, root and umask (CLONE_FS)",
            ),
        ]
        .into_iter()
        .enumerate()
        {
            let parents = self.of.get(&ppid).map(|o| o[k]);
            let candidates: &[i32] = match &parents {
                Some(o) if parent_only => std::slice::from_ref(o),
                _ if parent_only => &[],
                _ => &self.owners[k],
            };
            let owner = candidates
                .iter()
                .copied()
                .find(|&o| shares(pid, o, what).unwrap_or(false));
            let Some(owner) = owner else {
                self.owners[k].push(pid);
                continue;
            };
            if self.of.get(&ppid).map(|o| o[k]) != Some(owner) {
                return Err(CheckpointError::unsupported(
                    pid,
                    format!("a process sharing the {name} of process {owner}, which its parent {ppid} does not share (a restore shares it only with the parent that creates the process)"),
                ));
            }
            out[k] = Some(owner);
            mine[k] = owner;
        }
        self.of.insert(pid, mine);
        Ok(out)
    }
}

/// Kind "tree" of the frozen process `pid` (its parent `ppid`), next in
/// tree order: whose fd table and fs information it shares (see [`Tables`]).
pub fn shared(
    stash: &mut crate::kinds::Stash,
    pid: i32,
    ppid: i32,
    p: &mut Process,
) -> Result<(), CheckpointError> {
    let [files, fs] = stash.get::<Tables>().add_among(pid, ppid, true)?;
    p.fd_table_of = files.map(|o| o as u32);
    p.fs_of = fs.map(|o| o as u32);
    Ok(())
}

/// `root` and its descendants as they are now (not frozen), root first.
pub fn walk(root: i32) -> Result<Vec<i32>, CheckpointError> {
    let mut out = Vec::new();
    let mut queue = VecDeque::from([root]);
    let mut seen = BTreeSet::from([root]);
    while let Some(pid) = queue.pop_front() {
        out.push(pid);
        for c in proc::children(pid).unwrap_or_default() {
            if seen.insert(c) {
                queue.push_back(c);
            }
        }
    }
    Ok(out)
}

/// Freeze `root` and all its descendants, parents before children.
pub fn freeze(root: i32) -> Result<Vec<Frozen>, CheckpointError> {
    let mut out = Vec::new();
    let mut queue = VecDeque::from([root]);
    let mut seen = BTreeSet::from([root]);
    while let Some(pid) = queue.pop_front() {
        crate::fault::check("seize")?;
        let stat = match proc::stat(pid) {
            Ok(s) => s,
            Err(_) if pid != root => continue, // exited and reaped meanwhile
            Err(_) => return Err(CheckpointError::NoSuchProcess(pid)),
        };
        if stat.state == 'Z' && pid != root {
            dead_leader(pid)?;
            out.push(zombie(pid, &stat));
            continue;
        }
        vfork_wait(pid)?;
        let tracees = match threads::seize_all(pid) {
            Ok(t) => t,
            Err(e) if pid != root => match proc::stat(pid) {
                // It exited after we froze its parent: now a zombie.
                Ok(s) if s.state == 'Z' => {
                    out.push(zombie(pid, &s));
                    continue;
                }
                _ => return Err(e),
            },
            Err(e) => return Err(e),
        };
        let stopped =
            (stat.state == 'T').then(|| tracees[0].group_stop_signal().unwrap_or(libc::SIGSTOP));
        out.push(Frozen {
            pid,
            tracees,
            stopped,
            zombie: None,
        });
        for c in proc::children(pid).map_err(|e| CheckpointError::from_sys(pid, e))? {
            if seen.insert(c) {
                queue.push_back(c);
            }
        }
    }
    Ok(out)
}

fn zombie(pid: i32, stat: &Stat) -> Frozen {
    Frozen {
        pid,
        tracees: Vec::new(),
        stopped: None,
        zombie: Some(stat.exit_code.unwrap_or(0)),
    }
}

/// The "tree" section of process `f`: its ids (outside and inside its PID
/// namespace) and its state.
pub fn ids(stat: &Stat, status: &Status, f: &Frozen, p: &mut Process) {
    p.pid = f.pid as u32;
    p.ppid = stat.ppid as u32;
    p.pgid = stat.pgrp as u32;
    p.sid = stat.session as u32;
    p.ns_pid = proc::ns_last(&status.nspid).unwrap_or(p.pid);
    p.ns_pgid = proc::ns_last(&status.nspgid).unwrap_or(p.pgid);
    p.ns_sid = proc::ns_last(&status.nssid).unwrap_or(p.sid);
    p.task.comm = stat.comm.clone();
    p.exit_signal = stat.exit_signal.unwrap_or(libc::SIGCHLD);
    p.state = match (f.zombie, f.stopped) {
        (Some(exit_status), _) => ProcState::Zombie { exit_status },
        (None, Some(signal)) => ProcState::Stopped { signal },
        (None, None) => ProcState::Running,
    };
}

/// Every live process of the tree (`images`, root first) is in the root's
/// namespace `kind` ("ipc", "mnt"; `what` names it for people: "an IPC").
pub fn same_namespace(images: &[Process], kind: &str, what: &str) -> Result<(), CheckpointError> {
    let Some(root) = images.first().map(|p| p.pid as i32) else {
        return Ok(());
    };
    let id = |pid: i32| cr_sys::ns::id(pid, kind).map_err(|e| CheckpointError::from_sys(pid, e));
    let root_ns = id(root)?;
    for p in images.iter().filter(|p| !p.is_zombie()) {
        if id(p.pid as i32)? != root_ns {
            return Err(CheckpointError::unsupported(
                p.pid as i32,
                format!("{what} namespace other than process {root}'s"),
            ));
        }
    }
    Ok(())
}

/// Namespaces a restore cannot make again: a tree in a user or time
/// namespace other than the checkpointer's is refused by name (restored
/// in ours, it would see other ids or clocks and run on silently wrong).
pub fn refuse_foreign_namespaces(images: &[Process]) -> Result<(), CheckpointError> {
    for p in images.iter().filter(|p| !p.is_zombie()) {
        let pid = p.pid as i32;
        for (kind, why) in [
            (
                "user",
                "a user namespace of its own (its ids and capabilities are mapped there)",
            ),
            ("time", "a time namespace of its own (its clock offsets)"),
            (
                "time_for_children",
                "a time namespace for its children (unshare -T)",
            ),
        ] {
            // A kernel without the kind has no link: nothing to refuse.
            if cr_sys::ns::differs(pid, kind).unwrap_or(false) {
                return Err(CheckpointError::unsupported(pid, why));
            }
        }
    }
    Ok(())
}

/// Whether `root` is PID 1 of a PID namespace below ours (started by
/// cr_run), so the tree is restored into a new namespace.
pub fn pidns_root(root: i32) -> Result<bool, CheckpointError> {
    let sys = |e| CheckpointError::from_sys(root, e);
    let own = proc::status(std::process::id() as i32).map_err(sys)?;
    let st = proc::status(root).map_err(sys)?;
    Ok(proc::ns_depth(&st.nspid) > proc::ns_depth(&own.nspid)
        && proc::ns_last(&st.nspid) == Some(1))
}

/// Let the frozen tree go after its image is committed: run on, stop, or
/// die (children first, so a parent is never reaped before its children
/// are gone). Killed processes are gone (their PIDs free for a restore)
/// when this returns, but for the root, which its own parent reaps.
pub fn let_go(procs: Vec<Frozen>, action: Action) -> Result<(), CheckpointError> {
    let pids: Vec<i32> = procs.iter().map(|f| f.pid).collect();
    // A process that was stopped goes first and is seen stopped again
    // before the others run (see `wait_stopped`).
    let (stopped, procs): (Vec<_>, Vec<_>) = procs
        .into_iter()
        .partition(|f| action == Action::Continue && f.stopped.is_some());
    let stopping: Vec<i32> = stopped.iter().map(|f| f.pid).collect();
    for f in stopped.into_iter().rev() {
        let pid = f.pid;
        for t in f.tracees {
            t.detach(0).map_err(|e| CheckpointError::from_sys(pid, e))?;
        }
    }
    wait_stopped(&stopping);
    for f in procs.into_iter().rev() {
        let pid = f.pid;
        let sys = |e| CheckpointError::from_sys(pid, e);
        match action {
            Action::Continue => {
                for t in f.tracees {
                    t.detach(0).map_err(sys)?;
                }
            }
            Action::Stop => {
                for t in f.tracees {
                    let sig = if t.tid() == pid { libc::SIGSTOP } else { 0 };
                    t.detach(sig).map_err(sys)?;
                }
            }
            // All the threads at once: they exit (and are reported) in no
            // order we can choose (see kill_and_reap_all: the last thread of
            // a PID namespace's init waits for its traced siblings to be
            // reaped; waiting for it first never returns).
            Action::Kill => {
                if !f.tracees.is_empty() {
                    cr_sys::ptrace::kill_and_reap_all(
                        pid,
                        f.tracees,
                        cr_sys::ptrace::KILL_REAP_TIMEOUT,
                    );
                }
            }
        }
    }
    if action == Action::Kill {
        // Its parent reaps the root; what we wait for is its exit, which
        // takes a while for a big process (its memory is freed first).
        let exited = |p: i32| proc::pid_holder(p).is_none_or(|h| h.zombie);
        wait_for(
            &pids[..1],
            KILLED_GONE_TIMEOUT,
            exited,
            "the killed root has not finished exiting",
        );
        // A zombie reparented to a subreaper (not init) is reaped when
        // that subreaper chooses: often only once we return (a test
        // harness waiting for us), so it is not waited for.
        let gone = |p: i32| match proc::pid_holder(p) {
            None => !cr_sys::clone::pid_exists(p),
            Some(h) => h.zombie && h.ppid != 1 && !pids.contains(&h.ppid),
        };
        wait_for(
            &pids[1..],
            KILLED_GONE_TIMEOUT,
            gone,
            "killed processes are not reaped yet; their PIDs stay taken until they are",
        );
    }
    Ok(())
}

/// Wait until each of `pids` is in its group stop again. A process let go
/// stopped (by a restore, or by a checkpoint that continues) takes its
/// stop only once it is scheduled, after the detach: the kernel wakes a
/// group-stopped tracee at PTRACE_DETACH and it stops again on its own.
/// Without this wait, its parent, let go meanwhile, could see it running
/// (state R, nothing for waitpid(WUNTRACED)), and a checkpoint right after
/// a restore a running process with a stop signal pending.
pub(crate) fn wait_stopped(pids: &[i32]) {
    for &pid in pids {
        let stopped = cr_sys::deadline::poll(
            std::time::Duration::from_secs(5),
            std::time::Duration::from_millis(1),
            || {
                Ok::<_, cr_sys::SysError>(match proc::stat(pid) {
                    Ok(st) => (st.state == 'T').then_some(()),
                    // Gone (killed meanwhile): nothing to wait for.
                    Err(_) => Some(()),
                })
            },
        );
        if !matches!(stopped, Ok(Some(()))) {
            tracing::warn!(
                pid,
                "process let go stopped is not stopped again within 5 s"
            );
        }
    }
}

/// How long a kill waits for the killed processes to be reaped.
const KILLED_GONE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Wait until `done` holds for each of `pids` (killed processes: gone,
/// reaped by init or a subreaper since their parents were killed too; the
/// root: exited), so their PIDs are free, or about to be, when the
/// checkpoint returns. After `timeout`, `late` is logged.
fn wait_for(pids: &[i32], timeout: std::time::Duration, done: impl Fn(i32) -> bool, late: &str) {
    let t0 = std::time::Instant::now();
    let mut pause = std::time::Duration::from_micros(200);
    loop {
        let left: Vec<i32> = pids.iter().copied().filter(|&p| !done(p)).collect();
        if left.is_empty() {
            return;
        }
        if t0.elapsed() > timeout {
            tracing::warn!(pids = ?left, "{late}");
            return;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(std::time::Duration::from_millis(20));
    }
}

/// `--verify`: the ids of a process (inside its own PID namespace for a
/// job) and its parent.
pub fn verify(c: &mut crate::verify::Compare<'_>, image: &Process, now: &Process) {
    if c.pidns {
        c.same("ids", "pid in its namespace", &image.ns_pid, &now.ns_pid);
        c.same(
            "ids",
            "process group in its namespace",
            &image.ns_pgid,
            &now.ns_pgid,
        );
        c.same(
            "ids",
            "session in its namespace",
            &image.ns_sid,
            &now.ns_sid,
        );
    } else {
        c.same("ids", "pid", &image.pid, &now.pid);
        // A group or session led by a process outside the image (the
        // shell's, a starter's) is not made again: the restored processes
        // stay in the restorer's (restore::set_process_groups), wherever
        // the restore runs from.
        let ours = if c.restored {
            proc::stat(std::process::id() as i32)
                .ok()
                .map(|s| (s.pgrp as u32, s.session as u32))
        } else {
            None
        };
        let group_ours = !c.is_image_pid(image.pgid) && Some(now.pgid) == ours.map(|o| o.0);
        let session_ours = !c.is_image_pid(image.sid) && Some(now.sid) == ours.map(|o| o.1);
        if !group_ours {
            c.same("ids", "process group", &image.pgid, &now.pgid);
        }
        if !session_ours {
            c.same("ids", "session", &image.sid, &now.sid);
        }
    }
    let owner = |o: Option<u32>| o.map(|o| c.image_pid(o));
    let (files, fs) = (owner(now.fd_table_of), owner(now.fs_of));
    c.same("ids", "fd table shared with", &image.fd_table_of, &files);
    c.same(
        "ids",
        "working directory and umask shared with",
        &image.fs_of,
        &fs,
    );
    // The root's parent is whoever restored it.
    if c.pids.contains_key(&now.ppid) {
        c.same("ids", "parent", &image.ppid, &c.image_pid(now.ppid));
    }
    // The root is made by the restorer with SIGCHLD.
    if !(c.restored && c.root) {
        c.same("ids", "exit signal", &image.exit_signal, &now.exit_signal);
    }
    // A restored process is stopped again only at the release.
    if !c.restored {
        c.same("state", "job-control stop", &image.state, &now.state);
    }
}
