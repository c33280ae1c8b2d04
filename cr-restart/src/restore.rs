//! The restore of one process, start to finish, and [`Stub`]: the process
//! being rebuilt, driven by injected syscalls.

use crate::error::{RestoreError, StepContext};
use crate::objects::Objects;
use crate::{fds, memory, regs};
use cr_image::chain::{Chain, Piece};
use cr_image::proto;
use cr_sys::clone::{pid_exists, spawn_stub, spawn_stub_in_new_pidns, CloneError};
use cr_sys::proc::{self, MapEntry};
use cr_sys::ptrace::{wait_raw, OnDrop, Tracee};
use cr_sys::remote::{find_syscall_insn, Injector};
use cr_sys::{mem, PAGE_SIZE};
use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::path::Path;
use tracing::{debug, info, warn};

/// Scratch memory for syscall arguments inside the stub.
const SCRATCH: u64 = 64 * 1024;
/// The last bytes of the scratch area hold per-thread arguments (the largest:
/// supplementary groups).
const THREAD_ARGS: u64 = 12 * 1024;
/// Room after the scratch area where the vDSO pages are parked while moving.
const PARK: u64 = 64 * 1024;
const TASK_TOP: u64 = 0x7fff_ffff_f000;
const RSEQ_FLAG_UNREGISTER: u64 = 1;
const PR_SET_MM: u64 = 35;
const PR_SET_MM_MAP: u64 = 14;

#[derive(Debug, Clone)]
pub struct Options {
    /// Threads filling memory.
    pub workers: usize,
    pub show_progress: bool,
    /// The job was started from an interactive shell: it joins our session
    /// and becomes the foreground job of our terminal, and inherited
    /// terminals get their saved settings.
    pub shell_job: bool,
    /// IP addresses of sockets rewritten OLD -> NEW.
    pub addr_map: crate::inet::AddrMap,
    /// Seconds during which restored TCP connections ignore resets (their
    /// peer may be restored after them); 0: never.
    pub reset_guard_secs: u32,
}

/// A stub process being rebuilt: injected syscalls plus a scratch area for
/// their memory arguments.
pub struct Stub<'a> {
    inj: Injector<'a>,
    pid: i32,
    scratch: u64,
    cursor: u64,
    /// The stub's fd number of a pidfd of the restorer (see [`Stub::grab`]).
    grab_pidfd: Option<u64>,
}

impl Stub<'_> {
    /// Take the restorer's fd `ours` into the stub as fd `want` (the same
    /// open file description, through pidfd_getfd on the restorer's pidfd
    /// the stub inherited).
    pub fn grab(&mut self, ours: i32, want: i32, cloexec: bool) -> cr_sys::error::Result<()> {
        let pidfd = self
            .grab_pidfd
            .expect("grab pidfd set up before any fd is restored");
        let got = self.call(
            "pidfd_getfd",
            libc::SYS_pidfd_getfd,
            [pidfd, ours as u64, 0, 0, 0, 0],
        )?;
        self.place(got, want, cloexec)
    }

    /// Move the new fd `got` (close-on-exec, as pidfd_getfd makes it) to number `want`.
    pub fn place(&mut self, got: u64, want: i32, cloexec: bool) -> cr_sys::error::Result<()> {
        let flag = if cloexec { libc::O_CLOEXEC as u64 } else { 0 };
        if got == want as u64 {
            if !cloexec {
                self.call(
                    "fcntl(F_SETFD)",
                    libc::SYS_fcntl,
                    [got, libc::F_SETFD as u64, 0, 0, 0, 0],
                )?;
            }
            return Ok(());
        }
        self.call("dup3", libc::SYS_dup3, [got, want as u64, flag, 0, 0, 0])?;
        self.call("close", libc::SYS_close, [got, 0, 0, 0, 0, 0])?;
        Ok(())
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    pub fn call(
        &mut self,
        name: &'static str,
        nr: i64,
        args: [u64; 6],
    ) -> cr_sys::error::Result<u64> {
        self.inj.call(name, nr, args)
    }

    /// Copy bytes into the scratch area; returns their address in the stub.
    pub fn put(&mut self, data: &[u8]) -> cr_sys::error::Result<u64> {
        let len = (data.len() as u64 + 15) & !15;
        assert!(
            len <= SCRATCH,
            "argument of {} bytes exceeds the scratch area",
            data.len()
        );
        if self.cursor + len > SCRATCH {
            self.cursor = 0;
        }
        let addr = self.scratch + self.cursor;
        mem::write_vm(self.pid, addr, data)?;
        self.cursor += len;
        Ok(addr)
    }

    pub fn put_str(&mut self, s: &str) -> cr_sys::error::Result<u64> {
        self.put(&mem::cstring_bytes(s))
    }

    /// openat(AT_FDCWD, path, flags) inside the stub.
    pub fn open(&mut self, path: &str, flags: i32) -> cr_sys::error::Result<u64> {
        let p = self.put_str(path)?;
        self.call(
            "openat",
            libc::SYS_openat,
            [libc::AT_FDCWD as u64, p, flags as u64, 0, 0, 0],
        )
    }
}

/// PIDs of the image's processes at restore time. Images taken from a job
/// in its own PID namespace (cr_run) are restored into a new namespace:
/// there the processes see their saved ids ("inner"), while the restorer
/// traces them under new ones ("outer"). Otherwise both are the saved PIDs.
pub struct Ids {
    pub pidns: bool,
    outer: HashMap<u32, i32>,
    inner: HashMap<u32, u32>,
}

impl Ids {
    fn new(ck: &proto::Checkpoint) -> Ids {
        Ids {
            pidns: ck.pidns,
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
    pub fn inner_tid(&self, th: &proto::Thread) -> u32 {
        if self.pidns {
            th.ns_tid
        } else {
            th.tid
        }
    }

    /// Session and group of a process as it sees them (0: outside the image's namespace).
    fn sid_pgid(&self, p: &proto::Process) -> (u32, u32) {
        if self.pidns {
            (p.ns_sid, p.ns_pgid)
        } else {
            (p.sid, p.pgid)
        }
    }
}

/// Kills and reaps a freshly cloned stub until it is seized.
struct StubGuard(i32);

impl Drop for StubGuard {
    fn drop(&mut self) {
        if self.0 > 0 {
            let _ = cr_sys::ptrace::kill(self.0, libc::SIGKILL);
            let _ = wait_raw(self.0, 0);
        }
    }
}

/// Restore the image in `dir`: the whole process tree, every process with
/// its PID and every thread with its TID. The root runs again as a child of
/// the caller when this returns its PID.
pub fn restore(dir: &Path, opts: &Options) -> Result<i32, RestoreError> {
    prepare(dir, opts)?.release()
}

/// A restored tree, complete but not yet running: every thread is held by
/// the caller's thread (ptrace), so [`Ready::release`] must be called from
/// the same thread. Dropping it kills every process of the tree: a restore
/// that is not released leaves nothing behind.
pub struct Ready {
    ck: proto::Checkpoint,
    opts: Options,
    root_pid: i32,
    pidns: bool,
    objects: Objects,
    handoff: fds::Handoff,
    /// One per process of the image, in its order.
    stubs: Vec<Tracee>,
    /// The other threads of each process.
    threads: Vec<Vec<Tracee>>,
    /// The restorer's pidfd the stubs took their fds through.
    _me: std::os::fd::OwnedFd,
}

impl Ready {
    /// PID of the root (in the caller's PID namespace).
    pub fn pid(&self) -> i32 {
        self.root_pid
    }

    /// The image's root PID.
    pub fn image_pid(&self) -> i32 {
        self.ck.root_pid as i32
    }

    /// The image's network lock, handed to the caller, which removes it
    /// itself (several images' at once: see `cr_sys::netlock::unlock_many`)
    /// before calling [`Ready::release`].
    pub fn take_netlock(&mut self) -> Option<String> {
        Some(std::mem::take(&mut self.ck.netlock)).filter(|n| !n.is_empty())
    }

    /// Let every process run, all at once; the root's PID.
    pub fn release(self) -> Result<i32, RestoreError> {
        let Ready {
            ck,
            opts,
            root_pid,
            pidns,
            objects,
            mut handoff,
            stubs,
            threads,
            _me,
        } = self;
        let procs = &ck.processes;
        // Every thread of every process is ready and nothing of the tree
        // has run yet. Timers start now; a shell job takes the terminal;
        // zombies die, then children go before parents.
        handoff.arm_timers()?;
        // The image's network lock (same host, same namespace) goes now that
        // every connection exists again; then they leave repair mode.
        if !ck.netlock.is_empty() {
            match cr_sys::netlock::unlock(None, &ck.netlock) {
                Ok(true) => debug!(lock = ck.netlock, "network lock removed"),
                Ok(false) => {}
                Err(e) => {
                    warn!(error = %cr_sys::error::one_line(&e), "the image's network lock could not be removed")
                }
            }
        }
        objects.finish_inet(opts.reset_guard_secs)?;
        if opts.shell_job {
            take_terminal(root_pid);
        }
        let mut live = Vec::new();
        for ((p, t), th) in procs.iter().zip(stubs).zip(threads) {
            if p.zombie {
                make_zombie(t, p.exit_status)?;
            } else {
                live.push((p, t, th));
            }
        }
        for (p, t, th) in live.into_iter().rev() {
            for t in th {
                t.detach(0)?;
            }
            t.detach(if p.stopped { libc::SIGSTOP } else { 0 })?;
        }
        info!(
            root = root_pid,
            processes = procs.len(),
            pidns,
            "restored tree released"
        );
        Ok(root_pid)
    }
}

/// Rebuild the tree of the image in `dir`, every process frozen (see [`Ready`]).
pub fn prepare(dir: &Path, opts: &Options) -> Result<Ready, RestoreError> {
    let chain = Chain::open(dir)?;
    let img = chain.top().dir.clone();
    let ck = chain.top().ck.clone();
    if ck.pre_dump {
        return Err(RestoreError::PreDump(dir.to_path_buf()));
    }
    let pages = memory::Pages::open(&chain)?;
    let mut pieces: std::collections::HashMap<u32, Vec<Piece>> = Default::default();
    let procs = &ck.processes;
    crate::identity::check_caller(procs)?;
    let root = procs
        .first()
        .filter(|p| p.pid == ck.root_pid && !p.zombie)
        .ok_or_else(|| RestoreError::Unsupported("the image has no live root process".into()))?;
    for p in procs.iter().filter(|p| !p.zombie) {
        if p.threads.first().map(|t| t.tid) != Some(p.pid) {
            return Err(RestoreError::Unsupported(format!(
                "process {}: the first thread is not the main thread",
                p.pid
            )));
        }
        // A broken chain found now costs nothing; blocks are checked as
        // they are used.
        pieces.insert(p.pid, pages.resolve(p.pid)?);
    }
    let mut ids = Ids::new(&ck);
    // In a new PID namespace every id is free; here they must be.
    if !ids.pidns {
        for id in procs
            .iter()
            .flat_map(|p| std::iter::once(p.pid).chain(p.threads.iter().map(|t| t.tid)))
        {
            if pid_exists(id as i32) {
                return Err(CloneError::PidInUse(id as i32).into());
            }
        }
    }

    // One fd of ours per pipe, socket and file object, for a moment: as
    // many as the process may have.
    if let Some(&(soft, hard)) =
        cr_sys::limits::get_all(std::process::id() as i32)?.get(libc::RLIMIT_NOFILE as usize)
    {
        if soft < hard {
            let _ = cr_sys::limits::set(std::process::id() as i32, libc::RLIMIT_NOFILE, hard, hard);
        }
    }
    // Pipes, sockets and file contents first, in the restorer; the pidfd of
    // the restorer every stub inherits is how they take their fds.
    warn_other_netns(&ck);
    let objects = Objects::prepare(&img, &ck, &opts.addr_map)?;
    let me = cr_sys::fdio::pidfd_open(std::process::id() as i32)?;
    let mut handoff = fds::Handoff::default();

    // Stubs, parents before children: each child is forked by its parent's
    // stub, so the parent links are real.
    let root_pid = if ids.pidns {
        spawn_stub_in_new_pidns()?
    } else {
        spawn_stub(root.pid as i32)?
    };
    let mut guard = StubGuard(root_pid);
    let mut stubs: Vec<Option<Tracee>> = procs.iter().map(|_| None).collect();
    stubs[0] = Some(Tracee::seize(root_pid, STUB_OPTIONS, OnDrop::Kill)?);
    guard.0 = 0;
    ids.outer.insert(root.pid, root_pid);
    debug!(root_pid, pidns = ids.pidns, "root stub seized");
    for i in 0..procs.len() {
        let p = &procs[i];
        let mut t = stubs[i].take().ok_or_else(|| {
            RestoreError::Unsupported(format!("process {} has no parent in the image", p.pid))
        })?;
        // A session leader creates its session before forking: children inherit it.
        if ids.sid_pgid(p).0 == ids.inner(p.pid) && !p.zombie {
            inject_once(&mut t, "setsid", libc::SYS_setsid, [0; 6])?;
        }
        for (j, c) in procs.iter().enumerate().skip(1) {
            if c.ppid == p.pid {
                let child = fork_stub(&mut t, ids.inner(c.pid) as i32)?;
                debug!(
                    parent = t.tid(),
                    child = child.tid(),
                    inner = ids.inner(c.pid),
                    "stub forked"
                );
                ids.outer.insert(c.pid, child.tid());
                stubs[j] = Some(child);
            }
        }
        stubs[i] = Some(t);
    }
    let mut stubs: Vec<Tracee> = stubs
        .into_iter()
        .map(|s| s.expect("every stub created"))
        .collect();
    set_process_groups(procs, &mut stubs, &ids, opts.shell_job)?;

    let ctx = Ctx {
        ck: &ck,
        opts,
        ids: &ids,
        objects: &objects,
        grab_pidfd: me.as_raw_fd(),
    };
    let mut threads = Vec::with_capacity(procs.len());
    for (p, t) in procs.iter().zip(stubs.iter_mut()) {
        threads.push(if p.zombie {
            Vec::new()
        } else {
            let pieces = pieces.get(&p.pid).map_or(&[][..], |v| v.as_slice());
            debug!(pid = t.tid(), "rebuilding");
            rebuild(t, &ctx, p, &pages, pieces, &mut handoff)?
        });
    }
    Ok(Ready {
        opts: opts.clone(),
        root_pid,
        pidns: ids.pidns,
        objects,
        handoff,
        stubs,
        threads,
        _me: me,
        ck,
    })
}

/// Make the restored job (its process group) the foreground job of our
/// terminal, as the shell had made it before the checkpoint.
fn take_terminal(root: i32) {
    use std::os::fd::AsFd;
    let Some(tty) = [0, 1, 2]
        .into_iter()
        .filter_map(|fd| cr_sys::fdio::dup_own(fd).ok())
        .find(|fd| cr_sys::fdio::is_tty(fd.as_fd()))
    else {
        tracing::warn!("--shell-job: cr_restart has no terminal to hand over");
        return;
    };
    let pgrp = proc::read_stat(root)
        .map(|s| s.field(5) as i32)
        .unwrap_or(root);
    if let Err(e) = cr_sys::fdio::set_foreground(tty.as_fd(), pgrp) {
        tracing::warn!(error = %cr_sys::error::one_line(&e), "--shell-job: cannot make the job the foreground job");
    }
}

/// Close every fd the stub inherited except our pidfd, which moves to a
/// number the image does not use; raise its fd limit so high fd numbers can
/// be restored (the saved limits come back at the end).
fn keep_only_grab_fd(
    stub: &mut Stub<'_>,
    p: &proto::Process,
    ours: i32,
) -> Result<(), RestoreError> {
    let ours = ours as u64;
    if ours > 0 {
        stub.call(
            "close_range",
            libc::SYS_close_range,
            [0, ours - 1, 0, 0, 0, 0],
        )?;
    }
    stub.call(
        "close_range",
        libc::SYS_close_range,
        [ours + 1, u32::MAX as u64, 0, 0, 0, 0],
    )?;
    if let Some(&(_, hard)) = cr_sys::limits::get_all(stub.pid())?.get(libc::RLIMIT_NOFILE as usize)
    {
        cr_sys::limits::set(stub.pid(), libc::RLIMIT_NOFILE, hard, hard)?;
    }
    let used: std::collections::HashSet<i32> = p.fds.iter().map(|f| f.fd).collect();
    let free = (0..).find(|n| !used.contains(n)).expect("a free fd number") as u64;
    if free != ours {
        stub.call(
            "dup3",
            libc::SYS_dup3,
            [ours, free, libc::O_CLOEXEC as u64, 0, 0, 0],
        )
        .step(|| "cannot move the restorer's pidfd in the stub".into())?;
        stub.call("close", libc::SYS_close, [ours, 0, 0, 0, 0, 0])?;
    }
    stub.grab_pidfd = Some(free);
    Ok(())
}

/// What every process's rebuild needs.
struct Ctx<'a> {
    ck: &'a proto::Checkpoint,
    opts: &'a Options,
    ids: &'a Ids,
    objects: &'a Objects,
    /// Our pidfd's number, inherited by every stub.
    grab_pidfd: i32,
}

const STUB_OPTIONS: u64 = (libc::PTRACE_O_TRACESYSGOOD
    | libc::PTRACE_O_EXITKILL
    | libc::PTRACE_O_TRACECLONE
    | libc::PTRACE_O_TRACEFORK) as u64;

/// Run one syscall in a stub that has no scratch memory yet.
fn inject_once(
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

/// Fork a child stub with PID `pid` from stub `t` (clone3 with set_tid);
/// it arrives stopped and traced (PTRACE_O_TRACEFORK).
fn fork_stub(t: &mut Tracee, pid: i32) -> Result<Tracee, RestoreError> {
    let parent = t.tid();
    let ip = find_syscall_insn(parent)?;
    let mut inj = Injector::new(t, ip)?;
    let page = inj.mmap_anon(0, PAGE_SIZE)?;
    let mut bytes = (pid as u32 as u64).to_le_bytes().to_vec();
    // struct clone_args: flags, pidfd, child_tid, parent_tid, exit_signal,
    // stack, stack_size, tls, set_tid, set_tid_size, cgroup.
    let fields = [0, 0, 0, 0, libc::SIGCHLD as u64, 0, 0, 0, page, 1, 0];
    bytes.extend(fields.iter().flat_map(|v| v.to_le_bytes()));
    mem::write_vm(parent, page, &bytes)?;
    let r = inj
        .call(
            "clone3",
            libc::SYS_clone3,
            [page + 8, (bytes.len() - 8) as u64, 0, 0, 0, 0],
        )
        .step(|| format!("cannot create process {pid} as a child of {parent}"));
    let inj_new_task = inj.take_new_task();
    inj.call("munmap", libc::SYS_munmap, [page, PAGE_SIZE, 0, 0, 0, 0])?;
    inj.finish()?;
    let got = r?;
    debug!(parent, inner = got, outer = ?inj_new_task, "clone3 done");
    // Inside a new PID namespace clone3 answers the inner PID; ptrace told us
    // ours (never use the inner one here: it names another process).
    let outer = inj_new_task.ok_or_else(|| {
        RestoreError::Unsupported(format!("no fork event for process {pid} from {parent}"))
    })?;
    Ok(Tracee::attach_new(outer, OnDrop::Kill)?)
}

/// Process groups: leaders first, then members (a group must exist before
/// it is joined). Session leaders already lead their group.
fn set_process_groups(
    procs: &[proto::Process],
    stubs: &mut [Tracee],
    ids: &Ids,
    shell_job: bool,
) -> Result<(), RestoreError> {
    let in_tree =
        |pgid: u32| pgid != 0 && procs.iter().any(|p| ids.inner(p.pid) == pgid && !p.zombie);
    let i_am_root = |p: &proto::Process| procs.first().is_some_and(|r| r.pid == p.pid);
    for leaders in [true, false] {
        for (p, t) in procs.iter().zip(stubs.iter_mut()) {
            let (sid, pgid) = ids.sid_pgid(p);
            let me = ids.inner(p.pid);
            // A shell job's root led its own group in the shell's session.
            let own_group = shell_job && leaders && i_am_root(p) && !in_tree(sid) && sid != me;
            if !own_group && (p.zombie || sid == me || (pgid == me) != leaders || !in_tree(pgid)) {
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
    Ok(())
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

fn rebuild(
    tracee: &mut Tracee,
    ctx: &Ctx<'_>,
    p: &proto::Process,
    pages: &memory::Pages<'_>,
    pieces: &[Piece],
    handoff: &mut fds::Handoff,
) -> Result<Vec<Tracee>, RestoreError> {
    let (ck, opts, ids) = (ctx.ck, ctx.opts, ctx.ids);
    let pid = tracee.tid();
    let is_root = p.pid == ck.root_pid;
    let thread = &p.threads[0];
    let here = cr_sys::regs::xstate_xfeatures(&tracee.get_xstate()?).unwrap_or(0);
    let missing = ck.cpu_xfeatures & !here;
    if missing != 0 {
        return Err(RestoreError::CpuFeatures { missing });
    }
    let own_rseq = tracee.get_rseq()?;
    let stub_maps = proc::read_maps(pid)?;
    let ip = find_syscall_insn(pid)?;
    let others = {
        let inj = Injector::new(tracee, ip)?;
        let mut stub = Stub {
            inj,
            pid,
            scratch: 0,
            cursor: 0,
            grab_pidfd: None,
        };
        // Our glibc registered rseq for the stub; the kernel would write to
        // that area (about to be unmapped) on every preemption.
        if own_rseq.addr != 0 {
            stub.call(
                "rseq",
                libc::SYS_rseq,
                [
                    own_rseq.addr,
                    own_rseq.len as u64,
                    RSEQ_FLAG_UNREGISTER,
                    own_rseq.signature as u64,
                    0,
                    0,
                ],
            )
            .step(|| "cannot unregister the stub's rseq area".into())?;
        }
        let scratch = choose_scratch(&p.vmas, &stub_maps)?;
        stub.inj
            .mmap_anon(scratch, SCRATCH)
            .step(|| format!("cannot map scratch memory at {scratch:#x}"))?;
        stub.scratch = scratch;
        keep_only_grab_fd(&mut stub, p, ctx.grab_pidfd)?;
        unmap_stub(&mut stub, &stub_maps, scratch)?;
        move_vdso(&mut stub, &stub_maps, &p.vmas, scratch + SCRATCH, ip)?;

        let filled = memory::map_all(&mut stub, p, ids, ctx.objects, pieces)?;
        let bar = cr_image::progress::bar(
            opts.show_progress,
            memory::bytes(pieces),
            "restoring memory",
        );
        memory::fill(pid, pages, pieces, opts.workers, &|d| {
            if let Some(b) = &bar {
                b.set_position(d)
            }
        })?;
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        memory::finish(&mut stub, p, &filled)?;
        process_state(&mut stub, p)?;
        let fd_opts = fds::FdOptions {
            shell_job: opts.shell_job,
        };
        fds::restore(&mut stub, p.pid, &p.fds, ids, ctx.objects, handoff, fd_opts)?;
        if p.ctty_pty != 0 && ids.sid_pgid(p).0 == ids.inner(p.pid) {
            let fg = ck
                .objects
                .iter()
                .find(|o| {
                    o.kind == proto::ObjectKind::PtyObject as i32 && o.id == p.ctty_pty as u64 - 1
                })
                .map_or(0, |o| o.pty_fg_pgrp);
            fds::controlling_tty(&mut stub, p, ids, fg)?;
        }
        fds::reopen_dev_tty(&mut stub, p.pid, &p.fds)?;
        if let Some(h) = stub.grab_pidfd.take() {
            stub.call("close", libc::SYS_close, [h, 0, 0, 0, 0, 0])?;
        }
        mm_fields(&mut stub, p)?;
        signals(&mut stub, p)?;
        let mut others = create_threads(&mut stub, &p.threads[1..], ids)?;
        let ip = stub.inj.syscall_ip();
        let args = scratch + SCRATCH - THREAD_ARGS;
        for (t, th) in others.iter_mut().zip(&p.threads[1..]) {
            let mut inj = Injector::new(t, ip)?;
            thread_state(&mut inj, pid, args, th, is_root)?;
            if let Some(c) = &p.creds {
                crate::identity::set_creds(&mut inj, args, th.tid, c)?;
            }
            inj.finish_with_mask(th.sigmask)?;
            set_registers(t, th)?;
        }
        thread_state(&mut stub.inj, pid, args, thread, is_root)?;
        pending_signals(&mut stub, p, ids)?;
        itimers(&mut stub, p)?;
        crate::identity::set_rlimits(pid, &p.rlimits)?;
        if let Some(c) = &p.creds {
            crate::identity::set_creds(&mut stub.inj, args, thread.tid, c)?;
        }
        stub.call("munmap", libc::SYS_munmap, [scratch, SCRATCH, 0, 0, 0, 0])?;
        stub.inj.finish_with_mask(thread.sigmask)?;
        others
    };
    set_registers(tracee, thread)?;
    Ok(others)
}

/// Queue again every signal that was pending, with its siginfo. Queued from
/// the main thread, which the kernel lets send any si_code to its own process;
/// they stay pending (blocked) until the release.
fn pending_signals(stub: &mut Stub<'_>, p: &proto::Process, ids: &Ids) -> Result<(), RestoreError> {
    let pid = ids.inner(p.pid) as u64;
    let signo = |info: &[u8]| {
        info.get(0..4).map_or(0, |b| {
            u32::from_le_bytes(b.try_into().expect("4 bytes")) as u64
        })
    };
    for info in &p.shared_pending {
        let sig = signo(info);
        let addr = stub.put(info)?;
        stub.call(
            "rt_sigqueueinfo",
            libc::SYS_rt_sigqueueinfo,
            [pid, sig, addr, 0, 0, 0],
        )
        .step(|| format!("cannot queue pending signal {sig}"))?;
    }
    for th in &p.threads {
        for info in &th.pending {
            let sig = signo(info);
            let addr = stub.put(info)?;
            stub.call(
                "rt_tgsigqueueinfo",
                libc::SYS_rt_tgsigqueueinfo,
                [pid, ids.inner_tid(th) as u64, sig, addr, 0, 0],
            )
            .step(|| format!("cannot queue pending signal {sig} of thread {}", th.tid))?;
        }
    }
    Ok(())
}

/// Arm the interval timers again with what they had left.
fn itimers(stub: &mut Stub<'_>, p: &proto::Process) -> Result<(), RestoreError> {
    for t in &p.itimers {
        let mut v = Vec::with_capacity(32);
        for us in [t.interval_us, t.value_us] {
            v.extend_from_slice(&(us / 1_000_000).to_le_bytes());
            v.extend_from_slice(&(us % 1_000_000).to_le_bytes());
        }
        let addr = stub.put(&v)?;
        stub.call(
            "setitimer",
            libc::SYS_setitimer,
            [t.which as u64, addr, 0, 0, 0, 0],
        )
        .step(|| format!("cannot arm interval timer {}", t.which))?;
    }
    Ok(())
}

/// Registers (with the syscall-restart fix-ups) and XSAVE area of a thread.
fn set_registers(t: &Tracee, th: &proto::Thread) -> Result<(), RestoreError> {
    let saved = th
        .regs
        .as_ref()
        .ok_or_else(|| RestoreError::Unsupported(format!("thread {} without registers", th.tid)))?;
    let mut r = regs::from_proto(saved);
    regs::fix_syscall_restart(&mut r);
    t.set_regs(&r)?;
    t.set_xstate(&th.xstate)?;
    Ok(())
}

/// Create the threads after the main one, each with its TID; they arrive
/// stopped (PTRACE_O_TRACECLONE) and never run before the release.
fn create_threads(
    stub: &mut Stub<'_>,
    threads: &[proto::Thread],
    ids: &Ids,
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
        if !ids.pidns && pid_exists(tid) {
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

/// Per-thread state only the thread itself can set: clear-child-tid
/// address, parent-death signal, alternate signal stack, rseq area. `args`
/// is scratch memory.
fn thread_state(
    inj: &mut Injector<'_>,
    pid: i32,
    args: u64,
    th: &proto::Thread,
    is_root: bool,
) -> Result<(), RestoreError> {
    let tid = th.tid;
    inj.call(
        "set_tid_address",
        libc::SYS_set_tid_address,
        [th.clear_child_tid, 0, 0, 0, 0, 0],
    )?;
    // The root's parent is now the restorer, which may exit at once
    // (--detach): its parent-death signal would fire, so it is not restored.
    if th.pdeathsig != 0 && !is_root {
        inj.call(
            "prctl(PR_SET_PDEATHSIG)",
            libc::SYS_prctl,
            [
                libc::PR_SET_PDEATHSIG as u64,
                th.pdeathsig as u64,
                0,
                0,
                0,
                0,
            ],
        )
        .step(|| format!("cannot set the parent-death signal of thread {tid}"))?;
    }
    // The stub inherited the restorer's alternate stack: always replace it.
    let ss = th.sigaltstack.unwrap_or(proto::AltStack {
        sp: 0,
        flags: libc::SS_DISABLE,
        size: 0,
    });
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
        .step(|| format!("cannot set the alternate signal stack of thread {tid}"))?;
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

/// A free range for scratch + parking, outside both the saved VMAs and the
/// stub's current mappings.
fn choose_scratch(saved: &[proto::Vma], stub: &[MapEntry]) -> Result<u64, RestoreError> {
    let need = SCRATCH + PARK;
    let mut used: Vec<(u64, u64)> = saved.iter().map(|v| (v.start, v.end)).collect();
    used.extend(stub.iter().map(|m| (m.start, m.end)));
    used.sort();
    let mut cand: u64 = 1 << 32;
    for (s, e) in used {
        if e <= cand {
            continue;
        }
        if s >= cand + need {
            break;
        }
        cand = (e + PAGE_SIZE - 1) & !(PAGE_SIZE - 1);
    }
    if cand + need > TASK_TOP {
        return Err(RestoreError::Unsupported(
            "no free address range for the restorer".into(),
        ));
    }
    Ok(cand)
}

fn is_special(path: &str) -> bool {
    matches!(path, "[vdso]" | "[vvar]" | "[vvar_vclock]" | "[vsyscall]")
}

/// Unmap everything of the stub except the kernel's special mappings and the scratch area.
fn unmap_stub(stub: &mut Stub<'_>, maps: &[MapEntry], scratch: u64) -> Result<(), RestoreError> {
    let mut keep: Vec<(u64, u64)> = maps
        .iter()
        .filter(|m| is_special(&m.path))
        .map(|m| (m.start, m.end))
        .collect();
    keep.push((scratch, scratch + SCRATCH + PARK));
    keep.sort();
    let mut from = PAGE_SIZE;
    for (s, e) in keep.into_iter().chain([(TASK_TOP, TASK_TOP)]) {
        let s = s.min(TASK_TOP);
        if s > from {
            stub.call("munmap", libc::SYS_munmap, [from, s - from, 0, 0, 0, 0])
                .step(|| format!("cannot unmap the stub's memory {from:#x}-{s:#x}"))?;
        }
        from = from.max(e);
    }
    Ok(())
}

/// Move [vvar], [vvar_vclock] and [vdso] to where the image had them.
fn move_vdso(
    stub: &mut Stub<'_>,
    maps: &[MapEntry],
    saved: &[proto::Vma],
    park: u64,
    ip: u64,
) -> Result<(), RestoreError> {
    use proto::VmaKind as K;
    let names = [
        ("[vvar]", K::Vvar),
        ("[vvar_vclock]", K::VvarVclock),
        ("[vdso]", K::Vdso),
    ];
    let mut moves = Vec::new();
    for (name, kind) in names {
        let here = maps.iter().find(|m| m.path == name);
        let there = saved.iter().find(|v| v.kind == kind as i32);
        match (here, there) {
            (None, None) => {}
            (Some(h), Some(t)) if h.len() == t.end - t.start => {
                moves.push((name, h.start, t.start, h.len()))
            }
            (h, t) => {
                return Err(RestoreError::VdsoLayout(format!(
                    "{name}: {} pages here, {} in the image",
                    h.map_or(0, |m| m.len() / PAGE_SIZE),
                    t.map_or(0, |v| (v.end - v.start) / PAGE_SIZE)
                )))
            }
        }
    }
    let flags = (libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED) as u64;
    let vdso_here = moves.iter().find(|m| m.0 == "[vdso]").map(|m| m.1);
    // Park first, so a target may overlap where another one is now.
    let mut parked = Vec::new();
    let mut at = park;
    for &(name, from, to, len) in &moves {
        if from == to {
            continue;
        }
        stub.call("mremap", libc::SYS_mremap, [from, len, len, flags, at, 0])
            .step(|| format!("cannot move {name}"))?;
        if name == "[vdso]" {
            stub.inj.set_syscall_ip(ip - from + at);
        }
        parked.push((name, at, to, len));
        at += len;
    }
    for (name, from, to, len) in parked {
        stub.call("mremap", libc::SYS_mremap, [from, len, len, flags, to, 0])
            .step(|| format!("cannot move {name} to {to:#x}"))?;
        if name == "[vdso]" {
            stub.inj.set_syscall_ip(ip - vdso_here.unwrap_or(0) + to);
        }
    }
    Ok(())
}

fn process_state(stub: &mut Stub<'_>, p: &proto::Process) -> Result<(), RestoreError> {
    let cwd = stub.put_str(&p.cwd)?;
    stub.call("chdir", libc::SYS_chdir, [cwd, 0, 0, 0, 0, 0])
        .step(|| format!("cannot change directory to {}", p.cwd))?;
    stub.call("umask", libc::SYS_umask, [p.umask as u64, 0, 0, 0, 0, 0])?;
    stub.call(
        "personality",
        libc::SYS_personality,
        [p.personality as u64, 0, 0, 0, 0, 0],
    )
    .step(|| format!("cannot set personality {:#x}", p.personality))?;
    let comm = stub.put_str(&p.comm)?;
    stub.call(
        "prctl(PR_SET_NAME)",
        libc::SYS_prctl,
        [libc::PR_SET_NAME as u64, comm, 0, 0, 0, 0],
    )?;
    stub.call(
        "prctl(PR_SET_PDEATHSIG)",
        libc::SYS_prctl,
        [libc::PR_SET_PDEATHSIG as u64, 0, 0, 0, 0, 0],
    )?;
    Ok(())
}

/// PR_SET_MM_MAP: code/data/brk/stack/arg/env bounds, auxv and the exe link.
fn mm_fields(stub: &mut Stub<'_>, p: &proto::Process) -> Result<(), RestoreError> {
    let m = p.mm.unwrap_or_default();
    let auxv = stub.put(&p.auxv)?;
    let exe_fd = if p.exe.ends_with(" (deleted)") {
        None
    } else {
        Some(
            stub.open(&p.exe, libc::O_RDONLY | libc::O_CLOEXEC)
                .step(|| format!("cannot open the executable {}", p.exe))?,
        )
    };
    let mut map = Vec::with_capacity(104);
    for v in [
        m.start_code,
        m.end_code,
        m.start_data,
        m.end_data,
        m.start_brk,
        m.brk,
        m.start_stack,
        m.arg_start,
        m.arg_end,
        m.env_start,
        m.env_end,
        auxv,
    ] {
        map.extend_from_slice(&v.to_le_bytes());
    }
    map.extend_from_slice(&(p.auxv.len() as u32).to_le_bytes());
    map.extend_from_slice(&exe_fd.map_or(u32::MAX, |fd| fd as u32).to_le_bytes());
    let addr = stub.put(&map)?;
    let r = stub
        .call(
            "prctl(PR_SET_MM_MAP)",
            libc::SYS_prctl,
            [PR_SET_MM, PR_SET_MM_MAP, addr, map.len() as u64, 0, 0],
        )
        .step(|| format!("cannot set the mm fields (brk {:#x}, exe {})", m.brk, p.exe));
    if let Some(fd) = exe_fd {
        stub.call("close", libc::SYS_close, [fd, 0, 0, 0, 0, 0])?;
    }
    r.map(|_| ())
}

/// Every signal's disposition as saved (the stub inherited ours).
fn signals(stub: &mut Stub<'_>, p: &proto::Process) -> Result<(), RestoreError> {
    for sig in 1..=64u32 {
        if sig == libc::SIGKILL as u32 || sig == libc::SIGSTOP as u32 {
            continue;
        }
        let a = p.sigactions.iter().find(|a| a.signo == sig);
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
        stub.call(
            "rt_sigaction",
            libc::SYS_rt_sigaction,
            [sig as u64, addr, 0, 8, 0, 0],
        )
        .step(|| format!("cannot restore the action of signal {sig}"))?;
    }
    Ok(())
}

/// Wait for a restored child to end; returns a shell-style exit code.
pub fn wait_exit(pid: i32) -> Result<i32, RestoreError> {
    let (_, status) = wait_raw(pid, 0).map_err(|source| RestoreError::Wait { pid, source })?;
    Ok(exit_code(status))
}

/// A wait status as a shell shows it: the exit code, or 128 + the signal.
pub fn exit_code(status: i32) -> i32 {
    if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else if libc::WIFSIGNALED(status) {
        128 + libc::WTERMSIG(status)
    } else {
        1
    }
}

/// Sockets restored on the same boot into another network namespace than
/// the one they lived in are usually a mistake (`--netns` was forgotten).
fn warn_other_netns(ck: &proto::Checkpoint) {
    let has_inet = ck
        .objects
        .iter()
        .any(|o| o.kind == proto::ObjectKind::InetSocketObject as i32);
    let boot = proc::read_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let here = proc::read_link("/proc/self/ns/net").unwrap_or_default();
    if has_inet && !ck.netns.is_empty() && ck.boot_id == boot && ck.netns != here {
        warn!(
            image = ck.netns,
            here, "the image's sockets lived in another network namespace of this host; they are restored into this one (see cr_restart --netns)"
        );
    }
}
