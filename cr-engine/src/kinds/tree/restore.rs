//! Restore of kind "tree": a stub per process with its saved PID (clone3
//! `set_tid`; in a new PID namespace when the image's root was PID 1 of
//! one, and new IPC and mount namespaces when it had those), each forked by
//! its parent's stub so the parent links are real;
//! sessions (a session leader creates its session before it forks),
//! process groups; at the release, zombies die with their saved status and
//! the others run, children before parents.

use crate::error::{RestoreError, StepContext};
use cr_image::model::{Checkpoint, ProcState, Process};
use cr_sys::clone::{pid_exists, spawn_stub, spawn_stub_in_new_pidns};
use cr_sys::ptrace::{OnDrop, Tracee};
use cr_sys::remote::{find_syscall_insn, Injector};
use cr_sys::{mem, proc, PAGE_SIZE};
use std::collections::HashMap;
use tracing::debug;

/// Options every stub is seized with: it dies with us (EXITKILL), and its
/// forks and clones arrive traced.
const STUB_OPTIONS: u64 = (libc::PTRACE_O_TRACESYSGOOD
    | libc::PTRACE_O_EXITKILL
    | libc::PTRACE_O_TRACECLONE
    | libc::PTRACE_O_TRACEFORK) as u64;

/// The options a stub is traced with by whichever of our threads holds
/// it (ptrace options belong to the tracer: a stub handed over to
/// another thread, `Stub::unpark`, is seized with them again).
pub fn stub_options(ids: &Ids) -> u64 {
    if ids.seccomp_suspended {
        STUB_OPTIONS | cr_sys::ptrace::PTRACE_O_SUSPEND_SECCOMP
    } else {
        STUB_OPTIONS
    }
}

/// PIDs of the image's processes at restore time. Images taken from a job
/// in its own PID namespace (cr_run) are restored into a new namespace:
/// there the processes see their saved ids ("inner"), while the restorer
/// traces them under new ones ("outer"). Otherwise both are the saved PIDs.
#[derive(Clone)]
pub struct Ids {
    pub pidns: bool,
    /// The stubs are traced with PTRACE_O_SUSPEND_SECCOMP (the restorer
    /// has CAP_SYS_ADMIN and no filter of its own): the filters a thread
    /// gets back judge none of the calls injected after them (see
    /// `kinds::seccomp`).
    pub seccomp_suspended: bool,
    outer: HashMap<u32, i32>,
    inner: HashMap<u32, u32>,
}

impl Ids {
    pub fn new(ck: &Checkpoint) -> Ids {
        Ids {
            pidns: ck.pidns,
            seccomp_suspended: false,
            outer: HashMap::new(),
            inner: ck
                .processes
                .iter()
                .map(|p| (p.pid, if ck.pidns { p.ns_pid } else { p.pid }))
                .collect(),
        }
    }

    /// The PID of image process `pid` as the restorer sees it.
    pub fn outer(&self, pid: u32) -> i32 {
        self.outer.get(&pid).copied().unwrap_or(pid as i32)
    }

    /// The PID of image process `pid` as the restored processes see it.
    pub fn inner(&self, pid: u32) -> u32 {
        self.inner.get(&pid).copied().unwrap_or(pid)
    }

    /// The TID of a thread as the restored process sees it.
    pub fn inner_tid(&self, th: &cr_image::model::Thread) -> u32 {
        if self.pidns {
            th.ns_tid
        } else {
            th.tid
        }
    }

    /// Session and group of a process as it sees them (0: outside the image's namespace).
    pub fn sid_pgid(&self, p: &Process) -> (u32, u32) {
        if self.pidns {
            (p.ns_sid, p.ns_pgid)
        } else {
            (p.sid, p.pgid)
        }
    }

    /// In our PID namespace every saved id must be free (in a new one, all
    /// are). An id still held by a process that is exiting (a big one
    /// takes a while to free its memory) or by a zombie its parent is
    /// about to reap — the original, just killed by `cr_checkpoint --kill`
    /// — is waited for a little.
    pub fn check_free(&self, ck: &Checkpoint) -> Result<(), RestoreError> {
        if self.pidns {
            return Ok(());
        }
        let deadline = std::time::Instant::now() + DYING_HOLDER_WAIT;
        // The helpers of sessions whose leader is gone take the session's id.
        let helpers: Vec<u32> = plan(&ck.processes)?.helpers.iter().map(|h| h.sid).collect();
        for &sid in &helpers {
            if let Some(e) = taken(sid as i32).filter(|_| !pid_exists(sid as i32)) {
                return Err(e);
            }
        }
        for id in ck
            .processes
            .iter()
            .flat_map(|p| std::iter::once(p.pid).chain(p.threads.iter().map(|t| t.tid)))
            .chain(helpers.iter().copied())
        {
            let id = id as i32;
            let mut logged = false;
            while pid_exists(id) {
                let holder = proc::pid_holder(id);
                let dying = holder.as_ref().is_some_and(|h| h.exiting || h.zombie);
                if !dying || std::time::Instant::now() > deadline {
                    let by = holder.map_or_else(|| "another process".into(), |h| h.describe());
                    return Err(RestoreError::PidTaken { pid: id, by });
                }
                if !logged {
                    tracing::info!(
                        pid = id,
                        "waiting for the exiting process that holds this pid"
                    );
                    logged = true;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
        Ok(())
    }
}

/// How long a restore waits for the pids it needs to be freed by exiting
/// processes and zombies.
const DYING_HOLDER_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Kills and reaps a freshly cloned stub until it is seized.
pub(crate) struct StubGuard(pub(crate) i32);

impl Drop for StubGuard {
    fn drop(&mut self) {
        if self.0 > 0 {
            let _ = cr_sys::ptrace::kill(self.0, libc::SIGKILL);
            let _ = cr_sys::ptrace::wait_timed(self.0, 0, cr_sys::ptrace::KILL_REAP_TIMEOUT);
        }
    }
}

/// A stub per process of the image, parents before children, each seized
/// (and killed if we die); sessions and groups set. `before_fork(i, stub)`
/// runs in the stub of every live process `i` (image order) before it
/// forks its children, which inherit what it did (memory shared
/// copy-on-write: `kinds::memory::cow`).
pub fn spawn(
    ck: &Checkpoint,
    ids: &mut Ids,
    shell_job: bool,
    before_fork: &mut dyn FnMut(usize, &mut Tracee) -> Result<(), RestoreError>,
) -> Result<Vec<Tracee>, RestoreError> {
    let procs = &ck.processes;
    let root = &procs[0];
    let ns = namespaces(ck);
    let root_pid = if ids.pidns {
        spawn_stub_in_new_pidns(ns)?
    } else {
        spawn_stub(root.pid as i32, ns)?
    };
    let mut guard = StubGuard(root_pid);
    let mut stubs: Vec<Option<Tracee>> = procs.iter().map(|_| None).collect();
    // Its children inherit the options (PTRACE_O_TRACEFORK).
    // With PTRACE_O_SUSPEND_SECCOMP, the filters a process gets back
    // (installed by the restore as its last calls) do not judge what is
    // injected after them: the release, and `--verify`'s capture of the
    // restored tree.
    let mut suspended = true;
    let mut root_stub =
        Tracee::seize_past_seccomp(root_pid, STUB_OPTIONS, OnDrop::Kill, &mut suspended)?;
    ids.seccomp_suspended = suspended;
    guard.0 = 0;
    // Before it forks: its children are born in the namespace.
    crate::kinds::cgroups::enter_ns(ck, &mut root_stub)?;
    stubs[0] = Some(root_stub);
    ids.outer.insert(root.pid, root_pid);
    debug!(root_pid, pidns = ids.pidns, "root stub seized");
    // Children forked before their parent's setsid (see `super::early_children`).
    let plan = plan(procs)?;
    for i in 0..procs.len() {
        let p = &procs[i];
        let mut t = stubs[i].take().ok_or_else(|| {
            RestoreError::Unsupported(format!("process {} has no parent in the image", p.pid))
        })?;
        if !p.is_zombie() {
            before_fork(i, &mut t)?;
        }
        let kids: Vec<(usize, &Process)> = procs
            .iter()
            .enumerate()
            .skip(1)
            .filter(|(_, c)| c.ppid == p.pid)
            .collect();
        let helpers: Vec<&super::SessionHelper> =
            plan.helpers.iter().filter(|h| h.parent == p.pid).collect();
        let (helped, kids): (Vec<_>, Vec<_>) = kids
            .into_iter()
            .partition(|(_, c)| helpers.iter().any(|h| h.children.contains(&c.pid)));
        let (first, then): (Vec<_>, Vec<_>) = kids
            .into_iter()
            .partition(|(_, c)| plan.early.contains(&c.pid));
        // Those born in the session it was born in, then its own session:
        // a session leader creates it before forking the others, who
        // inherit it.
        fork_children(p, &mut t, first, ids, &mut stubs)?;
        if ids.sid_pgid(p).0 == ids.inner(p.pid) && !p.is_zombie() {
            inject_once(&mut t, "setsid", libc::SYS_setsid, [0; 6])?;
        }
        fork_children(p, &mut t, then, ids, &mut stubs)?;
        for h in helpers {
            let kids = helped
                .iter()
                .filter(|(_, c)| h.children.contains(&c.pid))
                .copied()
                .collect();
            fork_in_helper_session(p, &mut t, h, kids, ids, &mut stubs)?;
        }
        stubs[i] = Some(t);
    }
    let mut stubs: Vec<Tracee> = stubs
        .into_iter()
        .map(|s| {
            s.ok_or_else(|| {
                RestoreError::Unsupported("a process has no parent in the image".into())
            })
        })
        .collect::<Result<_, _>>()?;
    let sids: Vec<u32> = plan
        .helpers
        .iter()
        .map(|h| helper_sid(procs, h, ids))
        .collect();
    set_process_groups(procs, &mut stubs, ids, shell_job, &sids)?;
    Ok(stubs)
}

/// The sessions of the image's processes as [`super::early_children`]
/// plans them; its refusal names the process.
fn plan(procs: &[Process]) -> Result<super::SessionPlan, RestoreError> {
    super::early_children(&in_sessions(procs))
        .map_err(|(p, why)| RestoreError::Unsupported(format!("process {p}: {why}")))
}

/// The id of helper `h`'s session as the restored processes see it (its
/// PID): the session id of its first child (0 when outside the image's
/// PID namespace).
fn helper_sid(procs: &[Process], h: &super::SessionHelper, ids: &Ids) -> u32 {
    procs
        .iter()
        .find(|c| h.children.first() == Some(&c.pid))
        .map_or(0, |c| ids.sid_pgid(c).0)
}

/// Give `kids`, children of `p` (stub `t`) in the session of helper `h`
/// whose leader is gone, that session (see [`super::SessionHelper`]): `t`
/// forks a helper stub whose PID is the session's id, sharing `p`'s fd
/// table and fs information (so that what the children share or copy is
/// `p`'s), which calls setsid and forks the children with CLONE_PARENT
/// (their parent is `p`; their exit signal, SIGCHLD, is the helper's).
/// The helper then exits and is reaped by us, its tracer, while `p`
/// ignores SIGCHLD: the kernel then reaps it for `p` at once and sends
/// `p` no signal (its own action is put back right after).
fn fork_in_helper_session(
    p: &Process,
    t: &mut Tracee,
    h: &super::SessionHelper,
    kids: Vec<(usize, &Process)>,
    ids: &mut Ids,
    stubs: &mut [Option<Tracee>],
) -> Result<(), RestoreError> {
    let sid = kids.first().map_or(0, |(_, c)| ids.sid_pgid(c).0);
    if sid == 0 {
        return Err(RestoreError::Unsupported(format!(
            "process {}: a session whose leader is gone ({}), outside the image's PID namespace",
            h.children.first().copied().unwrap_or(0),
            h.sid
        )));
    }
    let share = (libc::CLONE_FILES | libc::CLONE_FS) as u64;
    let mut helper = fork_stub(t, sid as i32, share, libc::SIGCHLD)?;
    inject_once(&mut helper, "setsid", libc::SYS_setsid, [0; 6])?;
    debug!(
        sid,
        parent = t.tid(),
        "helper leads a session whose leader is gone"
    );
    let wanted = kids
        .iter()
        .map(|(_, c)| {
            let flags = sharing_flags(p, c)? | libc::CLONE_PARENT as u64;
            Ok((ids.inner(c.pid) as i32, flags, 0))
        })
        .collect::<Result<Vec<_>, RestoreError>>()?;
    let forked = fork_stubs(&mut helper, &wanted)?;
    place(kids, forked, t.tid(), ids, stubs);
    inject_with_page(t, |inj, page| {
        // struct sigaction (kernel): handler, flags, restorer, mask; the old one after it.
        let ignore: Vec<u8> = [libc::SIG_IGN as u64, 0, 0, 0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        mem::write_vm(inj.pid(), page, &ignore)?;
        let old = page + 64;
        let sigchld = libc::SIGCHLD as u64;
        inj.call(
            "rt_sigaction",
            libc::SYS_rt_sigaction,
            [sigchld, page, old, 8, 0, 0],
        )?;
        let exited = exit_helper(&mut helper);
        inj.call(
            "rt_sigaction",
            libc::SYS_rt_sigaction,
            [sigchld, old, 0, 8, 0, 0],
        )?;
        exited
    })
}

/// Make helper stub `h` exit (its tracer, the caller, reaps it).
fn exit_helper(h: &mut Tracee) -> Result<(), RestoreError> {
    let ip = find_syscall_insn(h.tid())?;
    let mut inj = Injector::new(h, ip)?;
    match inj.syscall_raw(libc::SYS_exit_group, [0; 6]) {
        Err(cr_sys::SysError::Exited { .. }) => Ok(()),
        Err(e) => Err(e.into()),
        Ok(_) => Err(RestoreError::Unsupported("exit_group returned".into())),
    }
}

/// The processes of the image as [`super::early_children`] takes them.
fn in_sessions(procs: &[Process]) -> Vec<super::InSession> {
    procs
        .iter()
        .map(|p| super::InSession {
            pid: p.pid,
            ppid: p.ppid,
            sid: p.sid,
            zombie: p.is_zombie(),
            exit_signal: p.exit_signal,
        })
        .collect()
}

/// Fork the stubs of `kids` (index in the image, process), children of
/// `p` whose stub is `t`, all through one injector and one page; each
/// goes to its place in `stubs`.
fn fork_children(
    p: &Process,
    t: &mut Tracee,
    kids: Vec<(usize, &Process)>,
    ids: &mut Ids,
    stubs: &mut [Option<Tracee>],
) -> Result<(), RestoreError> {
    let wanted = kids
        .iter()
        .map(|(_, c)| Ok((ids.inner(c.pid) as i32, sharing_flags(p, c)?, c.exit_signal)))
        .collect::<Result<Vec<_>, RestoreError>>()?;
    let forked = fork_stubs(t, &wanted)?;
    place(kids, forked, t.tid(), ids, stubs);
    Ok(())
}

/// The stubs `forked` for `kids` (index in the image, process), children
/// of the stub `parent`, each noted and put in its place in `stubs`.
fn place(
    kids: Vec<(usize, &Process)>,
    forked: Vec<Tracee>,
    parent: i32,
    ids: &mut Ids,
    stubs: &mut [Option<Tracee>],
) {
    for ((j, c), child) in kids.into_iter().zip(forked) {
        debug!(
            parent,
            child = child.tid(),
            inner = ids.inner(c.pid),
            "stub forked"
        );
        ids.outer.insert(c.pid, child.tid());
        stubs[j] = Some(child);
    }
}

/// The namespaces the tree had of its own besides its PID namespace (a
/// `cr_run` job), made new for the root's stub: its IPC namespace (kind
/// "sysv"), its mount namespace (kind "mounts") and its UTS namespace
/// (kind "uts").
fn namespaces(ck: &Checkpoint) -> u64 {
    let mut flags = 0;
    if ck.uts.is_some() {
        flags |= libc::CLONE_NEWUTS as u64;
    }
    if ck.sysv.as_ref().is_some_and(|s| s.own_namespace) {
        flags |= libc::CLONE_NEWIPC as u64;
    }
    if ck.mounts.is_some() {
        flags |= libc::CLONE_NEWNS as u64;
    }
    flags
}

/// Whether no process after `p` in the image shares what `of` tells
/// (`Process::fd_table_of`, `Process::fs_of`: the owner of its table):
/// the last to be rebuilt with it, which finishes it.
pub fn last_sharing(ck: &Checkpoint, p: &Process, of: impl Fn(&Process) -> Option<u32>) -> bool {
    let key = |q: &Process| of(q).unwrap_or(q.pid);
    let at = ck.processes.iter().position(|q| q.pid == p.pid);
    at.is_none_or(|i| ck.processes[i + 1..].iter().all(|q| key(q) != key(p)))
}

/// The clone flags that make child `c` of `p` share its parent's fd table
/// (CLONE_FILES) and fs information (CLONE_FS) as the image says; a
/// process sharing a table its parent does not is refused by name.
fn sharing_flags(p: &Process, c: &Process) -> Result<u64, RestoreError> {
    let mut flags = 0;
    for (of, flag, what) in [
        (
            (|q: &Process| q.fd_table_of) as fn(&Process) -> Option<u32>,
            libc::CLONE_FILES,
            "fd table",
        ),
        (
            |q: &Process| q.fs_of,
            libc::CLONE_FS,
            "working directory and umask",
        ),
    ] {
        let Some(owner) = of(c) else {
            continue;
        };
        if of(p).unwrap_or(p.pid) != owner {
            return Err(RestoreError::Unsupported(format!(
                "process {} shares the {what} of process {owner}, which its parent {} does not share",
                c.pid, p.pid
            )));
        }
        flags |= flag as u64;
    }
    Ok(flags)
}

/// Run one syscall in a stub that has no scratch memory yet.
pub fn inject_once(
    t: &mut Tracee,
    name: &'static str,
    nr: i64,
    args: [u64; 6],
) -> Result<u64, RestoreError> {
    let ip = find_syscall_insn(t.tid())?;
    let mut inj = Injector::new(t, ip)?;
    let r = inj
        .call(name, nr, args)
        .step(|| format!("{name} in process {}", inj.pid()))?;
    inj.finish()?;
    Ok(r)
}

/// Run `f` with an injector in a stub that has no scratch memory yet and a
/// page of scratch memory mapped in it (for the strings of the calls `f`
/// makes), unmapped afterwards whatever `f` answered.
pub fn inject_with_page<R>(
    t: &mut Tracee,
    f: impl FnOnce(&mut Injector<'_>, u64) -> Result<R, RestoreError>,
) -> Result<R, RestoreError> {
    let ip = find_syscall_insn(t.tid())?;
    let mut inj = Injector::new(t, ip)?;
    let page = inj.mmap_anon(0, PAGE_SIZE)?;
    let result = f(&mut inj, page);
    inj.call("munmap", libc::SYS_munmap, [page, PAGE_SIZE, 0, 0, 0, 0])?;
    inj.finish()?;
    result
}

/// Fork a child stub with PID `pid` from stub `t` (see [`fork_stubs`]).
fn fork_stub(
    t: &mut Tracee,
    pid: i32,
    flags: u64,
    exit_signal: i32,
) -> Result<Tracee, RestoreError> {
    let mut one = fork_stubs(t, &[(pid, flags, exit_signal)])?;
    one.pop()
        .ok_or_else(|| RestoreError::Unsupported(format!("process {pid} was not forked")))
}

/// Fork a child stub from stub `t` for each `(pid, flags, exit_signal)`,
/// in order (clone3 with set_tid and `flags`: CLONE_FILES, CLONE_FS; the
/// child sends `exit_signal` to its parent when it exits: SIGCHLD for
/// almost every process; a "clone" child that sends another, or none, is
/// seen only by a waitpid with __WCLONE or __WALL); each arrives stopped
/// and traced (PTRACE_O_TRACEFORK). One injector and one page of clone
/// arguments serve every child (a parent of 31 children: 4 ptrace stops
/// and one read of its maps each fewer). On a failure the children
/// already forked are killed (their [`Tracee`]s dropped).
fn fork_stubs(t: &mut Tracee, wanted: &[(i32, u64, i32)]) -> Result<Vec<Tracee>, RestoreError> {
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    let parent = t.tid();
    let ip = find_syscall_insn(parent)?;
    let mut inj = Injector::new(t, ip)?;
    let page = inj.mmap_anon(0, PAGE_SIZE)?;
    let mut forked = Vec::with_capacity(wanted.len());
    let mut failed = None;
    for &(pid, flags, exit_signal) in wanted {
        let mut bytes = (pid as u32 as u64).to_le_bytes().to_vec();
        // struct clone_args: flags, pidfd, child_tid, parent_tid, exit_signal,
        // stack, stack_size, tls, set_tid, set_tid_size, cgroup.
        let fields = [flags, 0, 0, 0, exit_signal as u64, 0, 0, 0, page, 1, 0];
        bytes.extend(fields.iter().flat_map(|v| v.to_le_bytes()));
        let one = mem::write_vm(parent, page, &bytes)
            .map_err(RestoreError::from)
            .and_then(|()| {
                let r = inj
                    .call(
                        "clone3",
                        libc::SYS_clone3,
                        [page + 8, (bytes.len() - 8) as u64, 0, 0, 0, 0],
                    )
                    .step(|| format!("cannot create process {pid} as a child of {parent}"));
                let new_task = inj.take_new_task();
                let got = r.map_err(|e| taken(pid).unwrap_or(e))?;
                debug!(parent, inner = got, outer = ?new_task, "clone3 done");
                // Inside a new PID namespace clone3 answers the inner PID; ptrace
                // told us ours (never use the inner one here: it names another process).
                let outer = new_task.ok_or_else(|| {
                    RestoreError::Unsupported(format!(
                        "no fork event for process {pid} from {parent}"
                    ))
                })?;
                Ok(Tracee::attach_new(outer, OnDrop::Kill)?)
            });
        match one {
            Ok(child) => forked.push(child),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    inj.call("munmap", libc::SYS_munmap, [page, PAGE_SIZE, 0, 0, 0, 0])?;
    inj.finish()?;
    match failed {
        Some(e) => Err(e),
        None => Ok(forked),
    }
}

/// Why a clone3 with `set_tid` `pid` failed, when the number is taken: by
/// a process, or as the group or session id of one (processes of the
/// tree's group or session that left the tree: daemons that forked and
/// exited, now children of init; the kernel keeps a number while a group
/// or session has it).
fn taken(pid: i32) -> Option<RestoreError> {
    let by = match proc::pid_holder(pid) {
        Some(h) => h.describe(),
        None => {
            let (holder, what) = proc::group_or_session_of(pid)?;
            let comm = proc::stat(holder).map(|s| s.comm).unwrap_or_default();
            format!("the {what} of process {holder} (`{comm}`), outside the image: the kernel keeps the number while a group or session has it")
        }
    };
    Some(RestoreError::PidTaken { pid, by })
}

/// Process groups: leaders first, then members (a group must exist before
/// it is joined). Session leaders already lead their group. A group whose
/// leader is gone (it made the group, then exited and was reaped; its
/// members, a zombie among them, live on) gets a helper as its leader for
/// the time the members join it ([`leaderless_groups`]).
fn set_process_groups(
    procs: &[Process],
    stubs: &mut [Tracee],
    ids: &Ids,
    shell_job: bool,
    helper_sids: &[u32],
) -> Result<(), RestoreError> {
    // A zombie that led a group (it did setpgid, then exited) leads it
    // again: the group lives on while its zombie leader or any member does.
    let in_tree = |pgid: u32| pgid != 0 && procs.iter().any(|p| ids.inner(p.pid) == pgid);
    let i_am_root = |p: &Process| procs.first().is_some_and(|r| r.pid == p.pid);
    let mut helpers = Vec::new();
    // A group named after a helper's session is the helper's, inherited.
    let groups = leaderless_groups(procs, ids)
        .into_iter()
        .filter(|(pgid, _)| !helper_sids.contains(pgid));
    for (pgid, host) in groups {
        let mut h = fork_stub(&mut stubs[host], pgid as i32, 0, 0)?;
        inject_once(&mut h, "setpgid", libc::SYS_setpgid, [0; 6])?;
        debug!(
            pgid,
            host = stubs[host].tid(),
            "helper leads a group whose leader is gone"
        );
        helpers.push((pgid, host, h));
    }
    let helped = |pgid: u32| helpers.iter().any(|h| h.0 == pgid);
    for leaders in [true, false] {
        for (p, t) in procs.iter().zip(stubs.iter_mut()) {
            let (sid, pgid) = ids.sid_pgid(p);
            let me = ids.inner(p.pid);
            // A shell job's root led its own group in the shell's session.
            let own_group = shell_job && leaders && i_am_root(p) && !in_tree(sid) && sid != me;
            let joins = (pgid == me) == leaders && (in_tree(pgid) || helped(pgid));
            if !own_group && (sid == me || !joins) {
                continue;
            }
            let pgid = if own_group { 0 } else { pgid };
            inject_once(
                t,
                "setpgid",
                libc::SYS_setpgid,
                [0, pgid as u64, 0, 0, 0, 0],
            )?;
        }
    }
    for (pgid, host, mut h) in helpers {
        // It exits (no exit signal: its parent is not told) and its
        // parent reaps it; the group lives on with its members.
        exit_helper(&mut h)?;
        inject_once(
            &mut stubs[host],
            "wait4",
            libc::SYS_wait4,
            [pgid as u64, 0, libc::__WALL as u64, 0, 0, 0],
        )?;
    }
    Ok(())
}

/// The process groups whose leader is not in the image (it made the
/// group, then exited and was reaped) but live members are, or zombies:
/// each with the index of the member whose stub forks the group's
/// helper (the first, which is in the group's session). Not the root's
/// group: a root led by a process outside (the shell's or the starter's
/// group) stays in the restorer's.
fn leaderless_groups(procs: &[Process], ids: &Ids) -> Vec<(u32, usize)> {
    let in_tree = |id: u32| procs.iter().any(|p| ids.inner(p.pid) == id);
    let root_pgid = procs.first().map(|r| ids.sid_pgid(r).1);
    let mut out: Vec<(u32, usize)> = Vec::new();
    for (i, p) in procs.iter().enumerate() {
        let pgid = ids.sid_pgid(p).1;
        if pgid == 0 || in_tree(pgid) || Some(pgid) == root_pgid || out.iter().any(|o| o.0 == pgid)
        {
            continue;
        }
        out.push((pgid, i));
    }
    out
}

/// Let the tree run: zombies die first (with their saved status); then a
/// process that was stopped by job control is released stopped, by the
/// signal that stopped it when that signal would stop it again
/// ([`stop_signal`]), else by SIGSTOP, and seen stopped; then the others
/// run, children before parents.
pub fn release(
    procs: &[Process],
    stubs: Vec<Tracee>,
    threads: Vec<Vec<Tracee>>,
) -> Result<(), RestoreError> {
    let mut live = Vec::new();
    for ((p, t), th) in procs.iter().zip(stubs).zip(threads) {
        match p.state {
            ProcState::Zombie { exit_status } => make_zombie(t, exit_status)?,
            _ => live.push((p, t, th)),
        }
    }
    // The stopped processes go first, and are seen stopped before any
    // other runs: a detached process takes its stop signal only once it is
    // scheduled, and a parent let go at the same time could see it running
    // (its state R, a waitpid(WUNTRACED) with nothing to report).
    let (stopped, running): (Vec<_>, Vec<_>) = live
        .into_iter()
        .partition(|(p, _, _)| matches!(p.state, ProcState::Stopped { .. }));
    let mut stopping = Vec::new();
    for (p, t, th) in stopped.into_iter().rev() {
        let ProcState::Stopped { signal } = p.state else {
            continue;
        };
        stopping.push(t.tid());
        let mut sig = libc::SIGSTOP;
        if signal != libc::SIGSTOP && stop_signal(procs, p, signal) {
            // Queued while every thread is held: delivered, as a stop with
            // its own signal, once they run.
            cr_sys::ptrace::kill(t.tid(), signal).map_err(|source| RestoreError::Step {
                what: format!("cannot stop process {} again", p.pid),
                source: cr_sys::SysError::Syscall {
                    what: format!("kill({}, {signal})", t.tid()),
                    source,
                },
            })?;
            sig = 0;
        }
        for t in th {
            t.detach(0)?;
        }
        t.detach(sig)?;
    }
    super::wait_stopped(&stopping);
    for (_, t, th) in running.into_iter().rev() {
        for t in th {
            t.detach(0)?;
        }
        t.detach(0)?;
    }
    Ok(())
}

/// Whether job-control signal `signal` (SIGTSTP, SIGTTIN, SIGTTOU) stops
/// `p` again: its action is the default, it is not blocked, and its group
/// is not orphaned (the kernel drops those signals then): some live member
/// of the group has its parent in another group of the same session (the
/// stopped process's own parent, or the parent of its group's leader when
/// it shares its parent's group). Otherwise SIGSTOP stops it (its
/// parent's waitpid(WUNTRACED) then reports SIGSTOP).
fn stop_signal(procs: &[Process], p: &Process, signal: i32) -> bool {
    let default = !p.signals.actions.iter().any(|a| a.signo == signal as u32);
    let blocked = p
        .threads
        .first()
        .is_some_and(|t| t.sigmask & (1u64 << (signal - 1)) != 0);
    default && !blocked && !orphaned_group(procs, p)
}

/// Whether the process group of `p` is orphaned as far as the image
/// tells: no live member has a parent (in the image) in another group of
/// the same session.
fn orphaned_group(procs: &[Process], p: &Process) -> bool {
    !procs
        .iter()
        .filter(|m| m.pgid == p.pgid && m.sid == p.sid && !m.is_zombie())
        .any(|m| {
            procs
                .iter()
                .any(|q| q.pid == m.ppid && q.pgid != p.pgid && q.sid == p.sid)
        })
}

/// Turn a stub into a zombie with the saved wait status.
fn make_zombie(mut t: Tracee, status: i32) -> Result<(), RestoreError> {
    if libc::WIFSIGNALED(status) {
        let sig = libc::WTERMSIG(status);
        if sig != libc::SIGKILL {
            // The stub inherited our dispositions; the signal must kill it.
            let ip = find_syscall_insn(t.tid())?;
            let mut inj = Injector::new(&mut t, ip)?;
            let act = inj.mmap_anon(0, PAGE_SIZE)?;
            inj.call(
                "rt_sigaction",
                libc::SYS_rt_sigaction,
                [sig as u64, act, 0, 8, 0, 0],
            )?;
            inj.finish_with_mask(0)?;
        }
        t.detach(sig)?;
        return Ok(());
    }
    let ip = find_syscall_insn(t.tid())?;
    let mut inj = Injector::new(&mut t, ip)?;
    match inj.syscall_raw(
        libc::SYS_exit_group,
        [libc::WEXITSTATUS(status) as u64, 0, 0, 0, 0, 0],
    ) {
        Err(cr_sys::SysError::Exited { .. }) => Ok(()),
        Err(e) => Err(e.into()),
        Ok(_) => Err(RestoreError::Unsupported("exit_group returned".into())),
    }
}
