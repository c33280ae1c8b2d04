//! The checkpoint of a process tree, start to finish.

use crate::objects::Objects;
use crate::tree::{self, Frozen};
use crate::{fault, fds, identity, memory, target, threads, tracking, CheckpointError};
use cr_image::chain::{self, Chain, Link, MemIndex};
use cr_image::store::StoreWriter;
use cr_image::{proto, ImageDir};
use cr_sys::ptrace::Tracee;
use cr_sys::remote::{find_syscall_insn, Injector};
use cr_sys::{mem, proc, regs, PAGE_SIZE};
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tracing::{debug, info};

/// What happens to the process after a successful dump.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Action {
    /// It runs on (the default).
    #[default]
    Continue,
    /// It is left stopped (SIGSTOP).
    Stop,
    /// It is killed (SIGKILL).
    Kill,
}

#[derive(Debug, Clone, Default)]
pub struct Options {
    pub dir: PathBuf,
    pub action: Action,
    /// fsync the image before it is committed.
    pub fsync: bool,
    /// Threads copying pages.
    pub workers: usize,
    /// Called with (bytes copied, bytes to copy) while memory is copied.
    pub show_progress: bool,
    /// Drop TCP connections not yet accepted by a listener (they cannot be
    /// restored into its queue) instead of refusing a --kill/--stop dump.
    pub tcp_skip_in_flight: bool,
    /// Incremental image: pages unchanged since this parent image are
    /// referenced, not stored.
    pub parent: Option<PathBuf>,
    /// Copy memory only, while the processes run on (they are frozen only
    /// to list their mappings and start dirty tracking).
    pub pre_dump: bool,
    /// Leave dirty-page tracking on in the processes for the next
    /// incremental checkpoint (implied by `pre_dump`).
    pub track_mem: bool,
    /// How pages unchanged since the parent are found.
    pub dirty: tracking::Choice,
    /// Name of the network lock (nft table), so a caller can record it
    /// before it exists [default: `cr_lock_ROOT_MILLIS`].
    pub lock_name: Option<String>,
    pub compression: proto::Compression,
}

#[derive(Debug, Clone)]
pub struct Summary {
    pub pid: i32,
    pub processes: usize,
    pub threads: usize,
    /// Bytes of pages read from the processes.
    pub page_bytes: u64,
    /// Bytes written to the page store (after dedup and compression).
    pub store_bytes: u64,
    /// Pages taken from the parent image.
    pub pages_parent: u64,
    /// How unchanged pages were found (of the root process).
    pub dirty: proto::DirtyMethod,
    pub vmas: usize,
    pub fds: usize,
    /// How long the process was frozen.
    pub frozen: Duration,
    /// Whole checkpoint.
    pub elapsed: Duration,
}

const NSIG: u32 = 64;

/// Checkpoint process `pid` and all its descendants into `opts.dir`.
pub fn checkpoint(pid: i32, opts: &Options) -> Result<Summary, CheckpointError> {
    let t0 = Instant::now();
    if opts.pre_dump {
        target::validate(pid)?;
        let method = tracking::method(opts.dirty)?;
        let parent = open_parent(opts)?;
        chain::check_overwrite(&opts.dir)?;
        let mem = MemCtx {
            parent: parent.as_ref().map(|c| c.top()),
            method,
            image_id: cr_image::new_image_id(),
        };
        let dir = ImageDir::create(&opts.dir)?;
        let result = pre_dump(pid, opts, &dir, &mem, t0);
        if result.is_err() {
            dir.discard_tmp();
        }
        return result;
    }
    let mut held = freeze(pid, opts, opts.action != Action::Continue)?;
    let summary = held.dump()?;
    held.finish(opts.action)?;
    Ok(Summary {
        elapsed: t0.elapsed(),
        ..summary
    })
}

/// Refuse unsupported resources before anything is touched.
fn preflight(pid: i32, opts: &Options) -> Result<(), CheckpointError> {
    let pids = tree::walk(pid)?;
    let mut scan = fds::Scan::new(&pids);
    scan.lock_network = opts.action != Action::Continue;
    scan.skip_in_flight = opts.tcp_skip_in_flight;
    for &p in &pids {
        match proc::read_stat(p) {
            Ok(s) if s.state != 'Z' => {
                identity::check(p)?;
                fds::collect(p, &mut scan, None)?;
            }
            _ => {}
        }
    }
    Ok(())
}

/// Freeze the tree of `pid` for a checkpoint into `opts.dir`, after the
/// same checks as [`checkpoint`]; with `lock_network`, its TCP connections
/// are also held still (see `cr_sys::netlock`), so that their state cannot
/// change until [`Held::finish`] or the drop — what a coordinated
/// checkpoint of several trees needs for a consistent cut.
pub fn freeze(pid: i32, opts: &Options, lock_network: bool) -> Result<Held, CheckpointError> {
    let t0 = Instant::now();
    target::validate(pid)?;
    let method = tracking::method(opts.dirty)?;
    let parent = open_parent(opts)?;
    chain::check_overwrite(&opts.dir)?;
    preflight(pid, opts)?;
    let dir = ImageDir::create(&opts.dir)?;
    let mut held = Held {
        root: pid,
        opts: opts.clone(),
        parent,
        image_id: cr_image::new_image_id(),
        method,
        dir,
        procs: Vec::new(),
        lock: None,
        frozen_at: Instant::now(),
        t0,
        dumped: None,
        let_go: false,
    };
    held.procs = tree::freeze(pid)?;
    held.frozen_at = Instant::now();
    debug!(root = pid, processes = held.procs.len(), "tree frozen");
    fault::check("after-seize")?;
    if lock_network {
        let pids: Vec<i32> = held.procs.iter().map(|f| f.pid).collect();
        held.lock = NetLock::take(pid, &pids, opts.lock_name.as_deref())?;
    }
    Ok(held)
}

/// A process tree frozen for a checkpoint (see [`freeze`]). Dropping it
/// before [`Held::finish`] aborts: every thread is detached and runs on
/// exactly as before, the network lock goes, and the image written by
/// [`Held::dump`] (if any) is removed.
pub struct Held {
    root: i32,
    opts: Options,
    parent: Option<Chain>,
    image_id: String,
    method: proto::DirtyMethod,
    dir: ImageDir,
    procs: Vec<Frozen>,
    lock: Option<NetLock>,
    frozen_at: Instant,
    t0: Instant,
    dumped: Option<Dumped>,
    /// [`Held::finish`] ran: the drop undoes nothing.
    let_go: bool,
}

/// What a written image leaves to do when the processes are let go.
struct Dumped {
    summary: Summary,
    repaired: Vec<crate::inet::Repaired>,
    /// Trackers left running: (pid, method, fd).
    kept: Vec<(i32, proto::DirtyMethod, i32)>,
    /// Trackers no longer wanted: released only after the processes run on.
    released: Vec<std::os::fd::OwnedFd>,
}

impl Held {
    /// PIDs of the frozen processes, root first.
    pub fn pids(&self) -> Vec<i32> {
        self.procs.iter().map(|f| f.pid).collect()
    }

    pub fn threads(&self) -> usize {
        self.procs.iter().map(|f| f.tracees.len()).sum()
    }

    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// How long the tree has been frozen.
    pub fn frozen_for(&self) -> Duration {
        self.frozen_at.elapsed()
    }

    /// For a caller locking several trees in one nft transaction
    /// (`cr_sys::netlock::lock_many`): what this tree's network lock `name`
    /// must hold (None: no TCP socket). From now on the tree owns the lock
    /// as if [`freeze`] had taken it (removing an absent one is harmless).
    pub fn plan_lock(&mut self, name: &str) -> Option<cr_sys::netlock::LockSet> {
        let set = crate::inet::lock_set(&self.pids());
        if set.conns.is_empty() && set.listeners.is_empty() {
            return None;
        }
        self.lock = Some(NetLock {
            name: name.to_string(),
            pid: self.root,
            conns: !set.conns.is_empty(),
            syn: (!set.listeners.is_empty()).then(|| format!("{name}_syn")),
            armed: true,
        });
        Some(set)
    }

    /// The tables of the network lock that [`Held::finish`] with `action`
    /// would remove, handed to the caller, which removes them itself
    /// (several trees' at once: see `cr_sys::netlock::unlock_many`) before
    /// calling `finish`.
    pub fn take_lock_tables(&mut self, action: Action) -> Vec<String> {
        let Some(l) = self.lock.as_mut() else {
            return Vec::new();
        };
        let mut out: Vec<String> = l.syn.take().into_iter().collect();
        if action == Action::Continue && l.conns && l.armed {
            out.push(l.name.clone());
            l.armed = false;
        }
        out
    }

    /// The bookmarks of every established TCP connection of the tree, read
    /// without consuming anything.
    pub fn bookmarks(&self) -> Vec<cr_image::bookmarks::Bookmark> {
        crate::inet::bookmarks(&self.pids())
    }

    /// Write and commit the image; the processes stay frozen.
    pub fn dump(&mut self) -> Result<Summary, CheckpointError> {
        if let Some(d) = &self.dumped {
            return Ok(d.summary.clone());
        }
        let mem = MemCtx {
            parent: self.parent.as_ref().map(|c| c.top()),
            method: self.method,
            image_id: self.image_id.clone(),
        };
        let result = dump_frozen(
            self.root,
            &self.opts,
            &self.dir,
            &mem,
            &mut self.procs,
            self.lock.as_ref(),
            self.frozen_at,
            self.t0,
        );
        match result {
            Ok(d) => {
                let summary = d.summary.clone();
                self.dumped = Some(d);
                Ok(summary)
            }
            Err(e) => {
                self.dir.discard_tmp();
                Err(e)
            }
        }
    }

    /// Let the processes go after [`Held::dump`]: run on, stop or die.
    pub fn finish(mut self, action: Action) -> Result<(), CheckpointError> {
        let Some(d) = self.dumped.take() else {
            return Err(CheckpointError::Unsupported {
                pid: self.root,
                what: "the processes cannot be let go before their image is written".into(),
            });
        };
        let mem = MemCtx {
            parent: self.parent.as_ref().map(|c| c.top()),
            method: self.method,
            image_id: self.image_id.clone(),
        };
        after_commit(&self.dir, &mem, &d.kept);
        // A lock kept for a dump that ends the processes belongs to the
        // image: cr_restart removes it. After a CONTINUE it goes now.
        if let Some(l) = self.lock.take() {
            if action != Action::Continue {
                l.keep();
            }
        }
        for r in d.repaired {
            if action == Action::Kill {
                r.keep(); // closed in repair mode by the kill: no FIN, no RST
            }
        }
        // Children first, so a killed parent is never reaped before its child is gone.
        for f in std::mem::take(&mut self.procs).into_iter().rev() {
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
                // The main thread is reported last, after all the others are gone.
                Action::Kill => {
                    for t in f.tracees.into_iter().rev() {
                        t.kill_and_reap();
                    }
                }
            }
        }
        drop(d.released);
        info!(
            root = self.root,
            processes = d.summary.processes,
            bytes = d.summary.page_bytes,
            stored = d.summary.store_bytes,
            frozen_ms = self.frozen_at.elapsed().as_millis() as u64,
            "checkpoint committed"
        );
        self.let_go = true;
        Ok(())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if self.let_go {
            return;
        }
        // Sockets leave repair mode and the lock goes before the threads are let go.
        if let Some(d) = self.dumped.take() {
            drop(d.repaired);
            if let Err(e) = std::fs::remove_dir_all(self.dir.path()) {
                tracing::warn!(dir = %self.dir.path().display(), error = %e, "cannot remove the image of an aborted checkpoint");
            }
        } else {
            self.dir.discard_tmp();
        }
        drop(self.lock.take());
        for f in std::mem::take(&mut self.procs).into_iter().rev() {
            drop(f);
        }
        debug!(root = self.root, "checkpoint aborted; the processes run on");
    }
}

/// What every process's memory dump shares.
struct MemCtx<'a> {
    parent: Option<&'a Link>,
    method: proto::DirtyMethod,
    image_id: String,
}

/// The parent image, its chain checked (ids, presence) before anything is frozen.
fn open_parent(opts: &Options) -> Result<Option<Chain>, CheckpointError> {
    let Some(p) = &opts.parent else {
        return Ok(None);
    };
    let err = |what: String| CheckpointError::Parent {
        path: p.clone(),
        what,
    };
    if let (Ok(a), Ok(b)) = (p.canonicalize(), opts.dir.canonicalize()) {
        if a == b {
            return Err(err(
                "it is also the directory of the new image; choose another --dir".into(),
            ));
        }
    }
    Chain::open(p)
        .map(Some)
        .map_err(|e| err(cr_sys::error::one_line(&e)))
}

/// After a commit: record the trackers left running and the new image as
/// a dependant of its parent.
fn after_commit(dir: &ImageDir, mem: &MemCtx<'_>, kept: &[(i32, proto::DirtyMethod, i32)]) {
    for &(pid, method, fd) in kept {
        tracking::save(pid, method, fd, &mem.image_id);
    }
    if let Some(p) = mem.parent {
        if let Err(e) = chain::add_dependant(p.dir.path(), dir.path(), &mem.image_id) {
            tracing::warn!(error = %cr_sys::error::one_line(&e), "cannot record the new image as a dependant of its parent");
        }
    }
}

fn parent_ref(dir: &ImageDir, mem: &MemCtx<'_>) -> Option<proto::ParentRef> {
    mem.parent.map(|p| proto::ParentRef {
        path: chain::relative_path(dir.path(), p.dir.path()),
        image_id: p.ck.image_id.clone(),
    })
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn sys_string(path: &str) -> String {
    proc::read_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Pre-dump: freeze the tree only to list its mappings and start dirty
/// tracking, then copy memory while it runs.
fn pre_dump(
    root: i32,
    opts: &Options,
    dir: &ImageDir,
    mem: &MemCtx<'_>,
    t0: Instant,
) -> Result<Summary, CheckpointError> {
    let store = StoreWriter::create(dir, &mem.image_id[..16], opts.compression)?;
    let mut procs = tree::freeze(root)?;
    let frozen_at = Instant::now();
    let mut shared = Shared::default();
    struct Work {
        pid: i32,
        proc: proto::Process,
        dirty: memory::Dirty,
        prepared: memory::Prepared,
        kept: Option<(proto::DirtyMethod, i32)>,
    }
    let mut work = Vec::new();
    for f in procs.iter_mut().filter(|f| f.zombie.is_none()) {
        let pid = f.pid;
        let sys = |e| CheckpointError::from_sys(pid, e);
        let stat = proc::read_stat(pid).map_err(sys)?;
        let maps = proc::read_smaps(pid).map_err(sys)?;
        let mut vmas = maps
            .iter()
            .map(|m| memory::classify(pid, m))
            .collect::<Result<Vec<_>, _>>()?;
        shared.assign_shm(pid, &mut vmas);
        let begun = tracking::begin(
            &mut f.tracees[0],
            &maps,
            &vmas,
            mem.parent
                .filter(|l| l.memory(pid as u32).is_some())
                .map(|l| l.ck.image_id.as_str()),
            mem.method,
            true,
        )?;
        let index = mem
            .parent
            .and_then(|l| l.memory(pid as u32))
            .map(MemIndex::new);
        let prepared = memory::prepare(&memory::DumpArgs {
            pid,
            vmas: &vmas,
            parent: index.as_ref(),
            dirty: &begun.dirty,
            store: &store,
            workers: opts.workers,
            tolerant: true,
        })?;
        if begun.clear_soft_dirty {
            cr_sys::dirty::clear_soft_dirty(pid).map_err(sys)?;
        }
        work.push(Work {
            pid,
            proc: proto::Process {
                pid: pid as u32,
                ppid: stat.ppid() as u32,
                comm: stat.comm.clone(),
                vmas,
                memory: Some(proto::Memory {
                    dirty: begun.used as i32,
                    ..Default::default()
                }),
                ..Default::default()
            },
            dirty: begun.dirty,
            prepared,
            kept: begun.kept,
        });
    }
    fault::check("pre-dump-frozen")?;
    // The processes run on from here; their memory is copied meanwhile.
    for f in procs.into_iter().rev() {
        drop(f);
    }
    let frozen = frozen_at.elapsed();
    let mut images = Vec::with_capacity(work.len());
    let mut kept = Vec::new();
    let mut read = 0u64;
    for w in work {
        let index = mem
            .parent
            .and_then(|l| l.memory(w.pid as u32))
            .map(MemIndex::new);
        let bar =
            cr_image::progress::bar(opts.show_progress, w.prepared.bytes(), "pre-dumping memory");
        read += w.prepared.bytes();
        let mut m = memory::dump(
            &memory::DumpArgs {
                pid: w.pid,
                vmas: &w.proc.vmas,
                parent: index.as_ref(),
                dirty: &w.dirty,
                store: &store,
                workers: opts.workers,
                tolerant: true,
            },
            w.prepared,
            &|done| {
                if let Some(b) = &bar {
                    b.set_position(done)
                }
            },
        )?;
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        let mut p = w.proc;
        m.dirty = p.memory.as_ref().map_or(0, |x| x.dirty);
        m.tracking = w.kept.map_or(0, |k| k.0 as i32);
        p.memory = Some(m);
        if let Some((method, fd)) = w.kept {
            kept.push((w.pid, method, fd));
        }
        images.push(p);
    }
    let store = store.finish(opts.fsync)?;
    let ck = proto::Checkpoint {
        tool_version: env!("CARGO_PKG_VERSION").to_string(),
        created_unix_ms: now_ms(),
        hostname: sys_string("/proc/sys/kernel/hostname"),
        kernel_release: sys_string("/proc/sys/kernel/osrelease"),
        boot_id: sys_string("/proc/sys/kernel/random/boot_id"),
        root_pid: root as u32,
        image_id: mem.image_id.clone(),
        parent: parent_ref(dir, mem),
        pre_dump: true,
        ..Default::default()
    };
    let summary = summarize(root, &images, &store, read, frozen, t0);
    let ck = proto::Checkpoint {
        processes: images,
        store: Some(store),
        ..ck
    };
    fault::check("before-commit")?;
    dir.commit(&ck, opts.fsync)?;
    after_commit(dir, mem, &kept);
    info!(
        root,
        frozen_ms = frozen.as_millis() as u64,
        "pre-dump committed"
    );
    Ok(summary)
}

fn summarize(
    root: i32,
    images: &[proto::Process],
    store: &proto::PageStore,
    read: u64,
    frozen: Duration,
    t0: Instant,
) -> Summary {
    let mems = || images.iter().filter_map(|p| p.memory.as_ref());
    Summary {
        pid: root,
        processes: images.len(),
        threads: images.iter().map(|p| p.threads.len()).sum(),
        page_bytes: read,
        store_bytes: store.size,
        pages_parent: mems()
            .filter_map(|m| m.stats.as_ref())
            .map(|s| s.pages_parent)
            .sum(),
        dirty: images
            .first()
            .and_then(|p| p.memory.as_ref())
            .and_then(|m| proto::DirtyMethod::try_from(m.dirty).ok())
            .unwrap_or_default(),
        vmas: images.iter().map(|p| p.vmas.len()).sum(),
        fds: images.iter().map(|p| p.fds.len()).sum(),
        frozen,
        elapsed: t0.elapsed(),
    }
}

/// One line of the pre-flight report (`cr_checkpoint --check`).
#[derive(Debug, Clone)]
pub struct CheckItem {
    pub pid: i32,
    /// "fd 3", "memory", "process".
    pub resource: String,
    pub what: String,
    /// Why it cannot be saved.
    pub refused: Option<String>,
}

/// List every resource of the tree under `pid` and whether it can be saved,
/// without touching the processes.
pub fn check(pid: i32) -> Result<Vec<CheckItem>, CheckpointError> {
    target::validate(pid)?;
    let pids = tree::walk(pid)?;
    let mut scan = fds::Scan::new(&pids);
    scan.deep = true;
    let mut out = Vec::new();
    for &p in &pids {
        let Ok(stat) = proc::read_stat(p) else {
            continue;
        };
        let item = |resource: &str, what: String, refused: Option<String>| CheckItem {
            pid: p,
            resource: resource.to_string(),
            what,
            refused,
        };
        if stat.state == 'Z' {
            out.push(item("process", format!("{} (zombie)", stat.comm), None));
            continue;
        }
        let threads = proc::list_tasks(p).map(|t| t.len()).unwrap_or(0);
        let refused = identity::check(p)
            .err()
            .map(|e| cr_sys::error::one_line(&e));
        out.push(item(
            "process",
            format!(
                "{} ({threads} threads, credentials, signals, timers)",
                stat.comm
            ),
            refused,
        ));
        let maps = proc::read_maps(p).map_err(|e| CheckpointError::from_sys(p, e))?;
        let bad: Vec<String> = maps
            .iter()
            .filter_map(|m| memory::classify(p, m).err())
            .map(|e| cr_sys::error::one_line(&e))
            .collect();
        out.push(item(
            "memory",
            format!("{} mappings", maps.len()),
            (!bad.is_empty()).then(|| bad.join("; ")),
        ));
        for r in fds::report(p, &mut scan) {
            out.push(item(&format!("fd {}", r.fd), r.what, r.refused));
        }
    }
    Ok(out)
}

/// Whether `root` is PID 1 of a PID namespace below ours (started by
/// cr_run), so the tree is restored into a new namespace.
fn pidns_root(root: i32) -> Result<bool, CheckpointError> {
    let sys = |e| CheckpointError::from_sys(root, e);
    let own = proc::read_status(std::process::id() as i32).map_err(sys)?;
    let st = proc::read_status(root).map_err(sys)?;
    Ok(st.ns_depth("NSpid") > own.ns_depth("NSpid") && st.ns_last("NSpid") == Some(1))
}

/// The process to checkpoint when the user names `pid`: for a `cr_run`
/// launcher, the job it runs (its only child, PID 1 of the job's namespace).
pub fn job_root(pid: i32) -> i32 {
    let is_cr_run = proc::read_link(&format!("/proc/{pid}/exe"))
        .map(|e| e.rsplit('/').next() == Some("cr_run"))
        .unwrap_or(false);
    match proc::children(pid) {
        Ok(kids) if is_cr_run && kids.len() == 1 => kids[0],
        _ => pid,
    }
}

/// The image directory a job was started with (`cr_run --dir`), from its environment.
pub fn job_dir(pid: i32) -> Option<PathBuf> {
    let env = proc::read_bytes(&format!("/proc/{pid}/environ")).ok()?;
    env.split(|&b| b == 0)
        .find_map(|kv| kv.strip_prefix(JOB_DIR_ENV.as_bytes())?.strip_prefix(b"="))
        .map(|v| PathBuf::from(String::from_utf8_lossy(v).into_owned()))
}

/// Environment variable cr_run sets to the job's default image directory.
pub const JOB_DIR_ENV: &str = "CR_CHECKPOINT_DIR";

/// Resources shared between processes (or fds of one process): the first
/// one seen owns it, later ones refer to it.
#[derive(Default)]
struct Shared {
    /// (dev, inode) of shared anonymous memory -> (owner pid, start, end).
    shm: HashMap<(u64, u64), (u32, u64, u64)>,
    /// fds seen so far, by link target: (pid, fd).
    fds: HashMap<String, Vec<(i32, i32)>>,
}

impl Shared {
    /// Shared anonymous memory seen in an earlier process refers to it.
    fn assign_shm(&mut self, pid: i32, vmas: &mut [proto::Vma]) {
        for v in vmas
            .iter_mut()
            .filter(|v| v.kind == proto::VmaKind::AnonShared as i32)
        {
            match self.shm.get(&(v.dev, v.inode)) {
                Some(&(opid, start, end)) => {
                    v.shm_owner_pid = opid;
                    v.shm_owner_start = start;
                    v.shm_owner_end = end;
                }
                None => {
                    self.shm
                        .insert((v.dev, v.inode), (pid as u32, v.start, v.end));
                }
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn dump_frozen(
    root: i32,
    opts: &Options,
    dir: &ImageDir,
    mem: &MemCtx<'_>,
    procs: &mut [Frozen],
    lock: Option<&NetLock>,
    frozen_at: Instant,
    t0: Instant,
) -> Result<Dumped, CheckpointError> {
    let store = StoreWriter::create(dir, &mem.image_id[..16], opts.compression)?;
    let mut shared = Shared::default();
    let pids: Vec<i32> = procs.iter().map(|f| f.pid).collect();
    // Scanned again now that nothing moves: sockets and pipes as they are.
    let mut scan = fds::Scan::new(&pids);
    scan.lock_network = opts.action != Action::Continue;
    scan.skip_in_flight = opts.tcp_skip_in_flight;
    let mut objects = Objects::new(dir, opts.fsync);
    let mut images = Vec::with_capacity(procs.len());
    let mut read = 0u64;
    let mut kept = Vec::new();
    let mut released = Vec::new();
    for f in procs.iter_mut() {
        images.push(capture_process(
            f,
            opts,
            mem,
            &store,
            &mut shared,
            &mut scan,
            &mut objects,
            &mut read,
            &mut kept,
            &mut released,
        )?);
    }
    let store = store.finish(opts.fsync)?;
    let repaired = std::mem::take(&mut objects.repaired);
    let objects = objects.into_vec();
    let cpu_xfeatures = images
        .iter()
        .flat_map(|p| p.threads.iter())
        .map(|t| regs::xstate_xfeatures(&t.xstate).unwrap_or(0))
        .fold(0, |a, b| a | b);
    let pidns = pidns_root(root)?;
    // The lock is recorded only when it outlives the dump (the processes
    // end); cr_restart removes it.
    let netlock = match lock {
        Some(l) if opts.action != Action::Continue => l.image_name(),
        _ => String::new(),
    };
    let ck = proto::Checkpoint {
        tool_version: env!("CARGO_PKG_VERSION").to_string(),
        created_unix_ms: now_ms(),
        hostname: sys_string("/proc/sys/kernel/hostname"),
        kernel_release: sys_string("/proc/sys/kernel/osrelease"),
        root_pid: root as u32,
        cpu_xfeatures,
        processes: images,
        pidns,
        objects,
        netlock,
        netns: proc::read_link(&format!("/proc/{root}/ns/net")).unwrap_or_default(),
        boot_id: sys_string("/proc/sys/kernel/random/boot_id"),
        image_id: mem.image_id.clone(),
        parent: parent_ref(dir, mem),
        store: Some(store),
        pre_dump: false,
    };
    fault::check("before-commit")?;
    dir.commit(&ck, opts.fsync)?;
    let summary = summarize(
        root,
        &ck.processes,
        ck.store.as_ref().expect("store set above"),
        read,
        frozen_at.elapsed(),
        t0,
    );
    Ok(Dumped {
        summary,
        repaired,
        kept,
        released,
    })
}

/// The network lock of a dump (see `cr_sys::netlock`), removed again if
/// the dump fails.
struct NetLock {
    name: String,
    pid: i32,
    /// Connections are locked (else only listeners are held).
    conns: bool,
    /// The listeners' table, removed when the dump ends, whatever happens.
    syn: Option<String>,
    armed: bool,
}

impl NetLock {
    /// Lock the TCP sockets of `pids` (None when they have none).
    fn take(
        root: i32,
        pids: &[i32],
        name: Option<&str>,
    ) -> Result<Option<NetLock>, CheckpointError> {
        let set = crate::inet::lock_set(pids);
        if set.conns.is_empty() && set.listeners.is_empty() {
            return Ok(None);
        }
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0);
        let name = name
            .map(str::to_string)
            .unwrap_or_else(|| format!("cr_lock_{root}_{stamp}"));
        let fail = |e| CheckpointError::NetLock {
            pid: root,
            conns: set.conns.len(),
            source: e,
        };
        let mut lock = NetLock {
            name: name.clone(),
            pid: root,
            conns: false,
            syn: None,
            armed: true,
        };
        if !set.listeners.is_empty() {
            let syn = format!("{name}_syn");
            cr_sys::netlock::hold_listeners(root, &syn, &set.listeners).map_err(fail)?;
            lock.syn = Some(syn);
        }
        if !set.conns.is_empty() {
            cr_sys::netlock::lock(root, &name, &set).map_err(fail)?;
            lock.conns = true;
        }
        debug!(
            name,
            conns = set.conns.len(),
            listeners = set.listeners.len(),
            "network locked"
        );
        Ok(Some(lock))
    }

    /// The name the image records: the connections' lock, if any.
    fn image_name(&self) -> String {
        if self.conns {
            self.name.clone()
        } else {
            String::new()
        }
    }

    /// The connections' lock stays for cr_restart.
    fn keep(mut self) {
        self.armed = false;
    }
}

impl Drop for NetLock {
    fn drop(&mut self) {
        let warn = |e: cr_sys::SysError| tracing::warn!(error = %cr_sys::error::one_line(&e), "removing the network lock failed");
        if let Some(syn) = &self.syn {
            cr_sys::netlock::unlock(Some(self.pid), syn).err().map(warn);
        }
        if self.armed && self.conns {
            cr_sys::netlock::unlock(Some(self.pid), &self.name)
                .err()
                .map(warn);
        }
    }
}

/// Everything about one frozen process; its pages go to its page file.
#[allow(clippy::too_many_arguments)]
fn capture_process(
    f: &mut Frozen,
    opts: &Options,
    m: &MemCtx<'_>,
    store: &StoreWriter,
    shared: &mut Shared,
    scan: &mut fds::Scan,
    objects: &mut Objects,
    read: &mut u64,
    kept: &mut Vec<(i32, proto::DirtyMethod, i32)>,
    released: &mut Vec<std::os::fd::OwnedFd>,
) -> Result<proto::Process, CheckpointError> {
    let pid = f.pid;
    let sys = |e| CheckpointError::from_sys(pid, e);
    let stat = proc::read_stat(pid).map_err(sys)?;
    let ids = (
        stat.ppid() as u32,
        stat.field(5) as u32,
        stat.field(6) as u32,
    );
    let status = proc::read_status(pid).map_err(sys)?;
    let ns = (
        status.ns_last("NSpid").unwrap_or(pid as u32),
        status.ns_last("NSpgid").unwrap_or(ids.1),
        status.ns_last("NSsid").unwrap_or(ids.2),
    );
    if let Some(exit) = f.zombie {
        return Ok(proto::Process {
            pid: pid as u32,
            ppid: ids.0,
            pgid: ids.1,
            sid: ids.2,
            ns_pid: ns.0,
            ns_pgid: ns.1,
            ns_sid: ns.2,
            comm: stat.comm.clone(),
            zombie: true,
            exit_status: exit,
            ..Default::default()
        });
    }
    // The state may have changed between the pre-flight and the freeze.
    identity::check(pid)?;
    let mut thread_states = f
        .tracees
        .iter()
        .map(threads::read)
        .collect::<Result<Vec<_>, _>>()
        .map_err(sys)?;
    fault::check("after-registers")?;
    let shared_pending = f.tracees[0].pending_signals(true).map_err(sys)?;
    let Injected {
        brk,
        sigactions,
        itimers,
        keep_caps,
        dumpable,
    } = inject_queries(&mut f.tracees, &mut thread_states).map_err(sys)?;

    let mut creds = identity::creds(&status);
    creds.keep_caps = keep_caps;
    creds.dumpable = Some(dumpable);
    let rlimits = cr_sys::limits::get_all(pid)
        .map_err(sys)?
        .into_iter()
        .map(|(soft, hard)| proto::RLimit { soft, hard })
        .collect();
    let personality = proc::read_string(&format!("/proc/{pid}/personality"))
        .ok()
        .and_then(|s| u32::from_str_radix(s.trim(), 16).ok())
        .unwrap_or(0);
    let mut fds = fds::collect(pid, scan, Some(objects))?;
    // Open file descriptions seen so far, per link text, kept in kcmp's
    // order: one binary search per fd instead of a comparison with every
    // earlier fd of the same name (all eventfds share one name).
    for fd in fds.iter_mut() {
        let seen = shared.fds.entry(fd.path.clone()).or_default();
        let at = seen.binary_search_by(|&(opid, ofd)| {
            cr_sys::mem::file_order(opid, ofd, pid, fd.fd).unwrap_or(std::cmp::Ordering::Less)
        });
        match at {
            Ok(i) => {
                fd.shared_pid = seen[i].0 as u32;
                fd.shared_fd = seen[i].1;
            }
            Err(i) => seen.insert(i, (pid, fd.fd)),
        }
    }
    let maps = proc::read_smaps(pid).map_err(sys)?;
    let mut vmas = maps
        .iter()
        .map(|m| memory::classify(pid, m))
        .collect::<Result<Vec<_>, _>>()?;
    for v in vmas
        .iter_mut()
        .filter(|v| v.path.starts_with("/memfd:") || v.path.ends_with(" (deleted)"))
    {
        let link = format!("/proc/{pid}/map_files/{:x}-{:x}", v.start, v.end);
        // A file really named "x (deleted)" still has a link.
        let gone = std::fs::metadata(&link).map(|m| {
            use std::os::unix::fs::MetadataExt;
            m.nlink() == 0
        });
        if gone.unwrap_or(false) {
            let memfd = v.path.starts_with("/memfd:");
            objects
                .content_from(&link, v.inode, &v.path, memfd)
                .map_err(|what| CheckpointError::Unsupported {
                    pid,
                    what: format!("mapping at {:#x} of {what}", v.start),
                })?;
            v.object = v.inode;
        }
    }
    shared.assign_shm(pid, &mut vmas);

    let keep = opts.track_mem && opts.action != Action::Kill;
    let mut begun = tracking::begin(
        &mut f.tracees[0],
        &maps,
        &vmas,
        m.parent
            .filter(|l| l.memory(pid as u32).is_some())
            .map(|l| l.ck.image_id.as_str()),
        m.method,
        keep,
    )?;
    let index = m
        .parent
        .and_then(|l| l.memory(pid as u32))
        .map(MemIndex::new);
    let args = memory::DumpArgs {
        pid,
        vmas: &vmas,
        parent: index.as_ref(),
        dirty: &begun.dirty,
        store,
        workers: opts.workers,
        tolerant: false,
    };
    let prepared = memory::prepare(&args)?;
    if begun.clear_soft_dirty {
        cr_sys::dirty::clear_soft_dirty(pid).map_err(sys)?;
    }
    *read += prepared.bytes();
    let bar = cr_image::progress::bar(opts.show_progress, prepared.bytes(), "dumping memory");
    let mut memory = memory::dump(&args, prepared, &|done| {
        if let Some(b) = &bar {
            b.set_position(done)
        }
    })?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    released.extend(begun.released.take());
    memory.dirty = begun.used as i32;
    memory.tracking = begun.kept.map_or(0, |k| k.0 as i32);
    if let Some((method, fd)) = begun.kept {
        kept.push((pid, method, fd));
    }
    Ok(proto::Process {
        pid: pid as u32,
        ppid: ids.0,
        pgid: ids.1,
        sid: ids.2,
        comm: stat.comm.clone(),
        exe: proc::read_link(&format!("/proc/{pid}/exe")).map_err(sys)?,
        cwd: proc::read_link(&format!("/proc/{pid}/cwd")).map_err(sys)?,
        umask: status.umask().unwrap_or(0o022),
        personality,
        mm: Some(proto::MmFields {
            start_code: stat.field(26),
            end_code: stat.field(27),
            start_stack: stat.field(28),
            start_data: stat.field(45),
            end_data: stat.field(46),
            start_brk: stat.field(47),
            brk,
            arg_start: stat.field(48),
            arg_end: stat.field(49),
            env_start: stat.field(50),
            env_end: stat.field(51),
        }),
        auxv: proc::read_bytes(&format!("/proc/{pid}/auxv")).map_err(sys)?,
        vmas,
        threads: thread_states,
        fds,
        memory: Some(memory),
        sigactions,
        cmdline: proc::read_bytes(&format!("/proc/{pid}/cmdline")).unwrap_or_default(),
        stopped: f.stopped,
        shared_pending,
        itimers,
        zombie: false,
        exit_status: 0,
        creds: Some(creds),
        rlimits,
        ns_pid: ns.0,
        ns_pgid: ns.1,
        ns_sid: ns.2,
        ctty_pty: fds::ctty_pty(stat.field(7), &scan.pty_masters).map_or(0, |i| i + 1),
    })
}

/// What the process told us through injected syscalls.
struct Injected {
    brk: u64,
    keep_caps: bool,
    /// PR_GET_DUMPABLE: 0, 1 or 2 (suid_dumpable).
    dumpable: u32,
    sigactions: Vec<proto::SigAction>,
    itimers: Vec<proto::ITimer>,
}

/// State only the process itself can tell: its brk, signal handlers and
/// interval timers, and per thread the clear-child-tid address and the
/// alternate signal stack.
fn inject_queries(
    tracees: &mut [Tracee],
    threads: &mut [proto::Thread],
) -> cr_sys::error::Result<Injected> {
    let pid = tracees[0].tid();
    let ip = find_syscall_insn(pid)?;
    let (brk, keep_caps, dumpable, scratch) = {
        let mut inj = Injector::new(&mut tracees[0], ip)?;
        let brk = inj.call("brk", libc::SYS_brk, [0; 6])?;
        let keep_caps = inj.call(
            "prctl(PR_GET_KEEPCAPS)",
            libc::SYS_prctl,
            [libc::PR_GET_KEEPCAPS as u64, 0, 0, 0, 0, 0],
        )? == 1;
        let dumpable = inj.call(
            "prctl(PR_GET_DUMPABLE)",
            libc::SYS_prctl,
            [libc::PR_GET_DUMPABLE as u64, 0, 0, 0, 0, 0],
        )? as u32;
        let scratch = inj.mmap_anon(0, PAGE_SIZE)?;
        inj.finish()?;
        (brk, keep_caps, dumpable, scratch)
    };
    let result = (|| {
        let actions = query_sigactions(&mut tracees[0], ip, scratch)?;
        let itimers = query_itimers(&mut tracees[0], ip, scratch)?;
        for (t, state) in tracees.iter_mut().zip(threads.iter_mut()) {
            let mut inj = Injector::new(t, ip)?;
            inj.call(
                "prctl(PR_GET_TID_ADDRESS)",
                libc::SYS_prctl,
                [PR_GET_TID_ADDRESS, scratch, 0, 0, 0, 0],
            )?;
            inj.call(
                "sigaltstack",
                libc::SYS_sigaltstack,
                [0, scratch + 8, 0, 0, 0, 0],
            )?;
            inj.call(
                "prctl(PR_GET_PDEATHSIG)",
                libc::SYS_prctl,
                [libc::PR_GET_PDEATHSIG as u64, scratch + 32, 0, 0, 0, 0],
            )?;
            inj.finish()?;
            let mut raw = [0u8; 36];
            mem::read_vm(pid, scratch, &mut raw)?;
            let word =
                |i: usize| u64::from_le_bytes(raw[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
            state.clear_child_tid = word(0);
            state.pdeathsig = i32::from_le_bytes(raw[32..36].try_into().expect("4 bytes"));
            state.sigaltstack = Some(proto::AltStack {
                sp: word(1),
                flags: word(2) as u32 as i32,
                size: word(3),
            });
        }
        Ok(Injected {
            brk,
            keep_caps,
            dumpable,
            sigactions: actions,
            itimers,
        })
    })();
    let unmapped = Injector::new(&mut tracees[0], ip).and_then(|mut inj| {
        inj.call("munmap", libc::SYS_munmap, [scratch, PAGE_SIZE, 0, 0, 0, 0])?;
        inj.finish()
    });
    let injected = result?;
    unmapped?;
    Ok(injected)
}

/// Armed interval timers, read with getitimer (the remaining time goes on
/// counting while the image waits; it is restored as it was read).
fn query_itimers(
    t: &mut Tracee,
    ip: u64,
    scratch: u64,
) -> cr_sys::error::Result<Vec<proto::ITimer>> {
    let pid = t.tid();
    let mut inj = Injector::new(t, ip)?;
    for which in 0..3u64 {
        inj.call(
            "getitimer",
            libc::SYS_getitimer,
            [which, scratch + which * 32, 0, 0, 0, 0],
        )?;
    }
    inj.finish()?;
    let mut raw = [0u8; 96];
    mem::read_vm(pid, scratch, &mut raw)?;
    let word = |i: usize| u64::from_le_bytes(raw[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    Ok((0..3)
        .filter_map(|w| {
            let b = w * 4;
            let interval_us = word(b) * 1_000_000 + word(b + 1);
            let value_us = word(b + 2) * 1_000_000 + word(b + 3);
            (value_us != 0).then_some(proto::ITimer {
                which: w as i32,
                interval_us,
                value_us,
            })
        })
        .collect())
}

const PR_GET_TID_ADDRESS: u64 = 40;

/// Every signal's disposition, read with rt_sigaction(sig, NULL, &old).
fn query_sigactions(
    t: &mut Tracee,
    ip: u64,
    scratch: u64,
) -> cr_sys::error::Result<Vec<proto::SigAction>> {
    let pid = t.tid();
    let mut inj = Injector::new(t, ip)?;
    for sig in 1..=NSIG {
        if sig == libc::SIGKILL as u32 || sig == libc::SIGSTOP as u32 {
            continue;
        }
        inj.call(
            "rt_sigaction",
            libc::SYS_rt_sigaction,
            [sig as u64, 0, scratch + (sig as u64 - 1) * 32, 8, 0, 0],
        )?;
    }
    inj.finish()?;
    let mut raw = vec![0u8; NSIG as usize * 32];
    mem::read_vm(pid, scratch, &mut raw)?;
    let mut actions = Vec::new();
    for sig in 1..=NSIG {
        let o = (sig as usize - 1) * 32;
        let f = |i: usize| {
            u64::from_le_bytes(raw[o + i * 8..o + i * 8 + 8].try_into().expect("8 bytes"))
        };
        let (handler, flags, restorer, mask) = (f(0), f(1), f(2), f(3));
        if handler != 0 || flags != 0 || mask != 0 {
            actions.push(proto::SigAction {
                signo: sig,
                handler,
                flags,
                restorer,
                mask,
            });
        }
    }
    Ok(actions)
}

/// Registers in their image form.
pub fn gpregs_to_proto(r: &regs::UserRegs) -> proto::GpRegs {
    proto::GpRegs {
        r15: r.r15,
        r14: r.r14,
        r13: r.r13,
        r12: r.r12,
        rbp: r.rbp,
        rbx: r.rbx,
        r11: r.r11,
        r10: r.r10,
        r9: r.r9,
        r8: r.r8,
        rax: r.rax,
        rcx: r.rcx,
        rdx: r.rdx,
        rsi: r.rsi,
        rdi: r.rdi,
        orig_rax: r.orig_rax,
        rip: r.rip,
        cs: r.cs,
        eflags: r.eflags,
        rsp: r.rsp,
        ss: r.ss,
        fs_base: r.fs_base,
        gs_base: r.gs_base,
        ds: r.ds,
        es: r.es,
        fs: r.fs,
        gs: r.gs,
    }
}
