//! The checkpoint of a process tree, start to finish.
//!
//! 1. [`freeze`]: check the target, refuse what cannot be saved before
//!    anything is touched (the fd pre-flight of
//!    `kinds::fds`), seize every thread of the tree (`kinds::tree`), and
//!    with `lock_network` hold its TCP connections still (`kinds::netlock`).
//! 2. [`Held::dump`]: each process in turn ([`capture_process`]) walks the
//!    kinds in a fixed order, each filling its section of the process image;
//!    then the page store and `checkpoint.img` are committed.
//! 3. [`Held::finish`]: the processes run on, stop or die.
//!
//! A pre-dump ([`pre_dump`]) freezes the tree only for the memory kind's
//! plan, then copies the pages while the processes run.
//!
//! Dropping a [`Held`] before `finish` aborts: every thread is detached and
//! runs on exactly as before, the network lock goes, and the image is removed.

use crate::error::CheckpointError;
use crate::kinds::fds::{Objects, TreeFds};
use crate::kinds::memory::{self, dump, tracking};
use crate::kinds::netlock::NetLock;
use crate::kinds::tree::{self, Frozen};
use crate::kinds::{self, Kind, Stash};
use crate::options::{Action, CheckpointOptions};
use crate::probe::Probe;
use crate::{fault, interrupt};
use cr_image::chain::{self, Chain, Link};
use cr_image::dir::data_files;
use cr_image::model::{Checkpoint, DirtyMethod, Meta, ParentRef, ProcState, Process};
use cr_image::store::StoreWriter;
use cr_image::ImageDir;
use cr_sys::proc::{self, Stat, Status};
use std::collections::HashSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tracing::{debug, info};

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
    pub dirty: DirtyMethod,
    pub vmas: usize,
    pub fds: usize,
    /// How long the processes were frozen.
    pub frozen: Duration,
    /// Whole checkpoint.
    pub elapsed: Duration,
}

/// Checkpoint process `pid` and all its descendants into `opts.dir`.
pub fn checkpoint(pid: i32, opts: &CheckpointOptions) -> Result<Summary, CheckpointError> {
    let t0 = Instant::now();
    if opts.pre_dump {
        return pre_dump(pid, opts);
    }
    let action = opts.action();
    // Continue: the processes run on as soon as their memory is copied out
    // (into room reserved now), and the image is written while they run.
    // (Not with --verify, which compares the tree with its image before
    // it runs on.)
    let arena = (action == Action::Continue && !opts.verify)
        .then(|| snapshot_arena(pid, opts.parent.is_some(), arena_budget()))
        .flatten();
    let mut held = freeze(pid, opts, action != Action::Continue, None, || true)?;
    held.arena = arena;
    let summary = held.dump()?;
    if opts.verify {
        held.verify()?;
    }
    held.finish(action)?;
    Ok(Summary {
        elapsed: t0.elapsed(),
        ..summary
    })
}

/// The most memory the copies of frozen trees may take on this machine:
/// half of what is available now.
pub fn arena_budget() -> u64 {
    cr_sys::proc::mem_available().unwrap_or(0) / 2
}

/// Room for the memory of the tree of `pid` (what it has resident, plus
/// an eighth), if that fits in `budget` bytes (see [`arena_budget`]);
/// reserved and faulted in now, before the tree is frozen. An
/// incremental dump (`incremental`) copies only what changed since its
/// parent, which is not known before the freeze: nothing is reserved
/// ahead (faulting in room for all its memory cost seconds per GiB), its
/// room is mapped when the copy needs it, within the same budget.
pub fn snapshot_arena(pid: i32, incremental: bool, budget: u64) -> Option<dump::Arena> {
    let resident: u64 = tree::walk(pid)
        .unwrap_or_default()
        .iter()
        .filter_map(|&p| proc::status(p).ok())
        .map(|st| (st.rssanon.unwrap_or(0) + st.rssshmem.unwrap_or(0)) * 1024)
        .sum();
    let want = if incremental {
        0
    } else {
        resident + resident / 8
    };
    if want > budget {
        info!(
            resident,
            budget, "not enough free memory to copy the processes out: they stay frozen until their memory is stored"
        );
        return None;
    }
    dump::Arena::new(want as usize, budget as usize)
        .inspect_err(|e| info!(error = %e, "cannot reserve memory to copy the processes out: they stay frozen until their memory is stored"))
        .ok()
}

/// What the network lock of the tree of `pid` must hold now, while it
/// runs (nothing: no TCP socket). A coordinated checkpoint installs it
/// before the freeze, and checks it against [`Held::plan_lock`] once the
/// tree is frozen.
pub fn lock_set(pid: i32) -> cr_sys::netlock::LockSet {
    kinds::inet::lock_set(&tree::walk(pid).unwrap_or_default())
}

/// What every process's capture of one dump shares.
pub struct Dump<'a> {
    pub opts: &'a CheckpointOptions,
    pub dir: &'a ImageDir,
    /// Where pages go; None: a capture for `--verify` (see `crate::verify`),
    /// which reads no page, no file content and no queued data.
    pub store: Option<&'a StoreWriter>,
    /// The parent image (incremental).
    pub parent: Option<&'a Link>,
    /// How unchanged pages are found.
    pub method: DirtyMethod,
    pub image_id: &'a str,
    /// What the tree's fds hold, gathered once.
    pub fds: TreeFds,
    /// Objects shared by fds and mappings.
    pub objects: Objects,
    /// What the kinds keep during this dump.
    pub stash: Stash,
    /// Bytes of pages read.
    pub read: u64,
    /// Where memory is copied while the tree is frozen, to be stored once
    /// it runs again (checkpoint-and-continue); None: stored while frozen.
    pub arena: Option<&'a mut dump::Arena>,
    /// Each process's mappings with their VmFlags, read from smaps before
    /// the freeze (see [`memory::EarlyMaps`]).
    pub early: Option<&'a memory::EarlyMaps>,
}

/// One frozen process being captured: what the kinds read it with.
pub struct Proc<'p, 'd> {
    pub pid: i32,
    pub stat: Stat,
    pub status: Status,
    /// In a job-control stop before we came.
    pub stopped: bool,
    pub probe: Probe<'p>,
    /// What the kinds ask the main thread, asked at once.
    pub main: crate::asked::MainAnswers,
    pub d: &'p mut Dump<'d>,
}

impl Dump<'_> {
    /// A capture for `--verify`: what can be compared, no data.
    pub fn verifying(&self) -> bool {
        self.store.is_none()
    }
}

impl Proc<'_, '_> {
    /// A low-level error of this process as the clearest checkpoint error.
    pub fn sys(&self, e: cr_sys::SysError) -> CheckpointError {
        CheckpointError::from_sys(self.pid, e)
    }
}

impl<'p, 'd> Proc<'p, 'd> {
    /// The frozen, live process `f`, with its section of kind "tree" filled
    /// in `p` (ids and state); with `ask`, its main thread asked what the
    /// kinds need of it ([`Proc::main`]; a pre-dump needs none of it).
    fn open(
        f: &'p mut Frozen,
        d: &'p mut Dump<'d>,
        p: &mut Process,
        ask: bool,
    ) -> Result<Self, CheckpointError> {
        let pid = f.pid;
        let sys = |e| CheckpointError::from_sys(pid, e);
        let (stat, status) = (
            proc::stat(pid).map_err(sys)?,
            proc::status(pid).map_err(sys)?,
        );
        tree::ids(&stat, &status, f, p);
        let mut probe = Probe::open(&mut f.tracees).map_err(sys)?;
        let main = if ask {
            crate::asked::main_thread(&mut probe, &status).map_err(sys)?
        } else {
            Default::default()
        };
        Ok(Proc {
            pid,
            stat,
            status,
            stopped: f.stopped.is_some(),
            probe,
            main,
            d,
        })
    }
}

/// Everything about one frozen process, kind by kind.
pub fn capture_process(f: &mut Frozen, d: &mut Dump<'_>) -> Result<Process, CheckpointError> {
    let pid = f.pid;
    let sys = |e| CheckpointError::from_sys(pid, e);
    let mut p = Process::default();
    if f.zombie.is_some() {
        let (stat, status) = (
            proc::stat(pid).map_err(sys)?,
            proc::status(pid).map_err(sys)?,
        );
        tree::ids(&stat, &status, f, &mut p);
        return Ok(p);
    }
    // Where a frozen process's time goes, kind by kind (µs, at debug level).
    let mut laps = Laps::new();
    let stops = cr_sys::remote::stops();
    let mut cx = Proc::open(f, d, &mut p, true)?;
    tree::shared(&mut cx.d.stash, pid, cx.stat.ppid, &mut p)?;
    laps.lap("open");
    kinds::threads::Threads::capture(&mut cx, &mut p)?;
    laps.lap("threads");
    fault::check("after-registers")?;
    kinds::signals::Signals::capture(&mut cx, &mut p)?;
    laps.lap("signals");
    kinds::seccomp::capture(&mut cx, &mut p)?;
    laps.lap("seccomp");
    kinds::timers::Timers::capture(&mut cx, &mut p)?;
    laps.lap("timers");
    kinds::identity::Identity::capture(&mut cx, &mut p)?;
    laps.lap("identity");
    kinds::task::Task::capture(&mut cx, &mut p)?;
    laps.lap("task");
    kinds::cgroups::Cgroups::capture(&mut cx, &mut p)?;
    laps.lap("cgroups");
    kinds::fds::Fds::capture(&mut cx, &mut p)?;
    laps.lap("fds");
    kinds::memory::Memory::capture(&mut cx, &mut p)?;
    laps.lap("memory");
    // A SIGSTOP that came while we injected (taken, see
    // `Tracee::take_stop`): the process would have stopped, so the image
    // says stopped.
    let taken = cx.probe.tracees().iter().find_map(|t| t.taken_stop());
    cx.probe.close().map_err(sys)?;
    laps.lap("close");
    if let (ProcState::Running, Some(signal)) = (p.state, taken) {
        p.state = ProcState::Stopped { signal };
    }
    // Stops: of its threads, waited for by injected calls.
    let stops = cr_sys::remote::stops() - stops;
    debug!(pid, laps = %laps, stops, "process captured (µs per kind)");
    Ok(p)
}

/// Time laps of a capture (or of a coordinated step), for the debug log.
pub struct Laps {
    at: Instant,
    laps: Vec<(&'static str, u128)>,
}

impl Default for Laps {
    fn default() -> Laps {
        Laps::new()
    }
}

impl Laps {
    pub fn new() -> Laps {
        Laps {
            at: Instant::now(),
            laps: Vec::new(),
        }
    }

    /// The time since the previous lap, as `name`'s.
    pub fn lap(&mut self, name: &'static str) {
        let now = Instant::now();
        self.laps.push((name, (now - self.at).as_micros()));
        self.at = now;
    }
}

impl std::fmt::Display for Laps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (name, us)) in self.laps.iter().enumerate() {
            write!(f, "{}{name}={us}", if i == 0 { "" } else { " " })?;
        }
        Ok(())
    }
}

/// The parent image, its chain checked (ids, presence) before anything is frozen.
fn open_parent(
    opts: &CheckpointOptions,
    dir: &std::path::Path,
) -> Result<Option<Chain>, CheckpointError> {
    let Some(p) = &opts.parent else {
        return Ok(None);
    };
    let err = |what: String| CheckpointError::Parent {
        path: p.clone(),
        what,
    };
    if let (Ok(a), Ok(b)) = (p.canonicalize(), dir.canonicalize()) {
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

/// Refuse unsupported resources before anything is touched.
/// What the pre-flight found that the frozen dump can use: the pipes held
/// outside the tree (see `kinds::pipes::Outside`).
fn preflight(
    pid: i32,
    opts: &CheckpointOptions,
) -> Result<Option<kinds::pipes::Outside>, CheckpointError> {
    kinds::outside::listed(&opts.save_file).map_err(CheckpointError::Invalid)?;
    let pids = tree::walk(pid)?;
    let mut fds = TreeFds::new(&pids);
    fds.lock_network = opts.action() != Action::Continue;
    fds.skip_in_flight = opts.tcp_skip_in_flight;
    fds.skip_queued_events = opts.skip_queued_events;
    let mut tables = tree::Tables::default();
    let mut sessions = Vec::with_capacity(pids.len());
    for &p in &pids {
        match proc::stat(p) {
            Ok(s) if s.state != 'Z' => {
                tree::vfork_wait(p)?;
                tables.add(p, s.ppid)?;
                sessions.push(tree::InSession {
                    pid: p as u32,
                    ppid: s.ppid as u32,
                    sid: s.session as u32,
                    zombie: false,
                    exit_signal: s.exit_signal.unwrap_or(libc::SIGCHLD),
                });
                kinds::fds::preflight(p, &mut fds)?
            }
            Ok(_) => tree::dead_leader(p)?,
            Err(_) => {}
        }
    }
    let plan = tree::early_children(&sessions)
        .map_err(|(p, why)| CheckpointError::unsupported(p as i32, why))?;
    tree::helpers_possible(&plan)?;
    Ok(kinds::pipes::Outside::take_early(&mut fds))
}

/// Run the libcr checkpoint callbacks of every process of the tree of
/// `pid` that uses libcr (see `coop`), nothing frozen; what [`freeze`]
/// then takes instead of running them itself. A coordinated checkpoint
/// runs every member's callbacks, on every node, before any freeze.
pub fn callbacks(pid: i32, opts: &CheckpointOptions) -> Result<crate::coop::Coop, CheckpointError> {
    crate::coop::prepare(&tree::walk(pid)?, &opts.image_dir(pid), opts.coop_limits())
}

/// Freeze the tree of `pid` for a checkpoint into `opts.dir`, after the
/// same checks as [`checkpoint`]; with `lock_network`, its TCP connections
/// are also held still (see `kinds::netlock`), so that their state cannot
/// change until [`Held::finish`] or the drop — what a coordinated
/// checkpoint of several trees needs for a consistent cut. `called_back`:
/// the tree's libcr callbacks already ran ([`callbacks`]); otherwise they
/// run here, just before the freeze. `before_freeze` runs once the checks
/// passed, right before the first thread is stopped (a coordinated
/// checkpoint waits there until every member of the node is ready, so
/// that none stays frozen while the others are still checked, and may
/// wait for every node's); if it returns false, nothing is frozen and
/// the checkpoint ends with [`CheckpointError::Interrupted`].
pub fn freeze(
    pid: i32,
    opts: &CheckpointOptions,
    lock_network: bool,
    called_back: Option<crate::coop::Coop>,
    before_freeze: impl FnOnce() -> bool,
) -> Result<Held, CheckpointError> {
    let t0 = Instant::now();
    tree::validate(pid)?;
    let path = opts.image_dir(pid);
    let method = tracking::method(opts.dirty)?;
    let parent = open_parent(opts, &path)?;
    chain::check_overwrite(&path)?;
    // Programs linked with libcr run their callbacks before anything is
    // checked, written or frozen (a callback closes what cannot be saved);
    // a refusal leaves nothing behind.
    let coop = match called_back {
        Some(c) => c,
        None => crate::coop::prepare(&tree::walk(pid)?, &path, opts.coop_limits())?,
    };
    // Connections queued on listeners cannot be saved once the processes
    // end: let the running program accept them first (before the
    // checks, which refuse them).
    let _drain = if lock_network && !opts.tcp_skip_in_flight {
        kinds::netlock::AcceptDrain::run(pid, &tree::walk(pid)?, kinds::drain::WAIT)?
    } else {
        None
    };
    // Likewise inotify and fanotify events queued and not read yet (a
    // coordinated checkpoint, whose network lock comes later, too).
    if opts.action() != Action::Continue && !opts.skip_queued_events {
        kinds::eventfds::wait_for_reads(&tree::walk(pid)?, kinds::drain::WAIT);
    }
    let outside_pipes = preflight(pid, opts)?;
    let dir = ImageDir::create(&path)?;
    let image_id = cr_image::new_image_id();
    // The page store's file is made now: a file created while frozen
    // waits for the filesystem's inode allocation, shared by every
    // member of a node dumping at once (ext4: `find_inode_bit`).
    let store = StoreWriter::create(&dir, &image_id[..16], opts.compress)?;
    let mut held = Held {
        coop: Some(coop),
        root: pid,
        opts: opts.clone(),
        parent,
        image_id,
        method,
        dir,
        store: Some(store),
        procs: Vec::new(),
        lock: None,
        frozen_at: Instant::now(),
        t0,
        dumped: None,
        let_go: false,
        arena: None,
        thawed_after: None,
        outside_pipes,
        // Before the freeze: groups are made and set up by whoever
        // manages them, not by the processes from one moment to the next.
        cgroup_dirs: kinds::cgroups::dirs::capture(&tree::walk(pid)?),
        // Not with --verify: it reads smaps while frozen anyway, and
        // compares every flag.
        early: if memory::early_wanted() && !opts.verify {
            memory::EarlyMaps::read(&tree::walk(pid)?)
        } else {
            memory::EarlyMaps::default()
        },
    };
    fault::hold("before-freeze")?;
    let checked = t0.elapsed();
    if !before_freeze() {
        // The caller called it off (its checkpoint ended meanwhile):
        // nothing is frozen; the directory goes with `held`.
        return Err(CheckpointError::Interrupted(
            "the end of the checkpoint before the freeze",
        ));
    }
    let waited = t0.elapsed() - checked;
    held.procs = tree::freeze(pid)?;
    held.frozen_at = Instant::now();
    debug!(
        root = pid,
        processes = held.procs.len(),
        checks_ms = checked.as_millis() as u64,
        waited_ms = waited.as_millis() as u64,
        "tree frozen (checks: before the freeze; waited: for the others' checks)"
    );
    fault::check("after-seize")?;
    if lock_network {
        let pids = held.pids();
        held.lock = NetLock::take(pid, &pids, opts.lock_name.as_deref())?;
    }
    Ok(held)
}

/// A process tree frozen for a checkpoint (see [`freeze`]).
pub struct Held {
    /// Its processes linked with libcr, told the outcome at the end (the
    /// drop of an aborted checkpoint tells them it failed).
    coop: Option<crate::coop::Coop>,
    root: i32,
    opts: CheckpointOptions,
    parent: Option<Chain>,
    image_id: String,
    method: DirtyMethod,
    dir: ImageDir,
    /// The page store, made before the freeze; taken by the dump (a dump
    /// tried again after a failure makes its own).
    store: Option<StoreWriter>,
    procs: Vec<Frozen>,
    lock: Option<NetLock>,
    frozen_at: Instant,
    t0: Instant,
    dumped: Option<Dumped>,
    /// [`Held::finish`] ran: the drop undoes nothing.
    let_go: bool,
    /// Room to copy memory into while frozen; with it the processes run on
    /// before their pages are stored (only for a dump that continues them).
    pub arena: Option<dump::Arena>,
    /// How long the tree was frozen, once it runs again before the end.
    thawed_after: Option<Duration>,
    /// The mappings read before the freeze, for their VmFlags.
    early: memory::EarlyMaps,
    /// The pipes held outside the tree, found before the freeze.
    outside_pipes: Option<kinds::pipes::Outside>,
    /// The control groups the tree relies on, read before the freeze.
    cgroup_dirs: Vec<cr_image::model::CgroupDir>,
}

/// What a written image leaves to do when the processes are let go.
struct Dumped {
    summary: Summary,
    /// Sockets in repair mode and the like (see `kinds::HeldState`).
    held: Vec<Box<dyn kinds::HeldState>>,
    /// Trackers left running: (pid, method, fd).
    kept: Vec<(i32, DirtyMethod, i32)>,
    /// Trackers no longer wanted: released only after the processes run on.
    released: Vec<tracking::Released>,
    /// Mappings whose VmFlags came from the read before the freeze:
    /// checked again when the processes are let go.
    borrowed: memory::Borrowed,
    /// The image's data files (page store, content files): the directory
    /// keeps them, and loses the replaced image's, once the processes
    /// are let go; a checkpoint called off removes them.
    files: HashSet<String>,
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

    /// How long the tree has been frozen (or was, if it runs again
    /// before the end: see [`Held::dump_with`]).
    pub fn frozen_for(&self) -> Duration {
        self.thawed_after
            .unwrap_or_else(|| self.frozen_at.elapsed())
    }

    /// For a caller locking several trees in one nft transaction
    /// (`cr_sys::netlock::lock_many`): what this tree's network lock `name`
    /// must hold (None: no TCP socket). From now on the tree owns the lock
    /// as if [`freeze`] had taken it (removing an absent one is harmless).
    pub fn plan_lock(&mut self, name: &str) -> Option<cr_sys::netlock::LockSet> {
        let (lock, set) = NetLock::plan(self.root, &self.pids(), name)?;
        self.lock = Some(lock);
        Some(set)
    }

    /// The tables of the network lock that [`Held::finish`] with `action`
    /// would remove, handed to the caller, which removes them itself
    /// (several trees' at once: see `cr_sys::netlock::unlock_many`) before
    /// calling `finish`.
    pub fn take_lock_tables(&mut self, action: Action) -> Vec<String> {
        self.lock
            .as_mut()
            .map_or_else(Vec::new, |l| l.take_tables(action == Action::Continue))
    }

    /// The bookmarks of every established TCP connection of the tree, read
    /// without consuming anything.
    pub fn bookmarks(&self) -> Vec<cr_image::bookmarks::Bookmark> {
        kinds::inet::bookmarks(&self.pids())
    }

    /// Write and commit the image; the processes stay frozen, unless the
    /// tree has an [`Held::arena`]: then they run on as soon as their
    /// memory is copied into it, and the image is written meanwhile.
    pub fn dump(&mut self) -> Result<Summary, CheckpointError> {
        self.dump_with(|| || {})
    }

    /// [`Held::dump`], where `before_run_on` runs once the whole state of
    /// the tree is read (its memory copied into the arena) and before its
    /// processes run on, and what it returns runs once they run, before
    /// their memory is stored; neither is called when they stay frozen (no
    /// arena, or the dump failed first). A coordinated checkpoint waits
    /// there for the other members of its node, and takes its turn to
    /// store once its processes run. The network lock, if any, holds
    /// until [`Held::finish`] or the drop: a tree that runs on before its
    /// image is committed cannot move its TCP connections meanwhile.
    pub fn dump_with<R: FnOnce()>(
        &mut self,
        before_run_on: impl FnOnce() -> R,
    ) -> Result<Summary, CheckpointError> {
        if let Some(d) = &self.dumped {
            return Ok(d.summary.clone());
        }
        match self.dump_frozen(before_run_on) {
            Ok(mut d) => {
                // Until the let-go, sockets are out of repair mode: should
                // we die meanwhile, the processes run on as they were.
                for h in d.held.iter_mut() {
                    h.pause();
                }
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

    fn dump_frozen<R: FnOnce()>(
        &mut self,
        before_run_on: impl FnOnce() -> R,
    ) -> Result<Dumped, CheckpointError> {
        let t_dump = Instant::now();
        let opts = &self.opts;
        let store = match self.store.take() {
            Some(s) => s,
            None => StoreWriter::create(&self.dir, &self.image_id[..16], opts.compress)?,
        };
        let pids = self.pids();
        // Scanned again now that nothing moves: sockets and pipes as they are.
        let mut fds = TreeFds::new(&pids);
        fds.lock_network = opts.action() != Action::Continue;
        fds.skip_in_flight = opts.tcp_skip_in_flight;
        fds.skip_queued_events = opts.skip_queued_events;
        if let Some(o) = self.outside_pipes.take() {
            o.seed(&mut fds);
        }
        let mut d = Dump {
            opts,
            dir: &self.dir,
            store: Some(&store),
            parent: self.parent.as_ref().map(|c| c.top()),
            method: self.method,
            image_id: &self.image_id,
            fds,
            objects: Objects::new(Some(self.dir.clone()), &self.image_id, opts.fsync()),
            stash: Stash::default(),
            read: 0,
            arena: self.arena.as_mut(),
            early: Some(&self.early),
        };
        let mut images = Vec::with_capacity(self.procs.len());
        for f in self.procs.iter_mut() {
            images.push(capture_process(f, &mut d)?);
        }
        // Read while nothing runs: System V objects and a job's mounts.
        let sysv = kinds::sysv::capture(&d, &images)?;
        let mounts = kinds::mounts::capture(&d, &images)?;
        tree::refuse_foreign_namespaces(&images)?;
        let uts = kinds::uts::capture(&images)?;
        let cgroupns = kinds::cgroups::capture_ns(&images)?;
        let cgroup_frames = match images.first() {
            Some(root) => kinds::cgroups::frames::capture(&opts.cgroup_root, root)?,
            None => Vec::new(),
        };
        let netns = kinds::netns::capture(&images)?;
        let own_shm = mounts.as_ref().is_some_and(|m| m.dev_shm.is_some());
        let made: Vec<String> = mounts
            .iter()
            .flat_map(|m| m.others.iter().map(|o| o.mount_point.clone()))
            .collect();
        let outside_files = kinds::outside::capture(&mut d, &pids, &images, own_shm, &made)?;
        let captured = t_dump.elapsed();
        if memory::has_snapshots(&mut d) {
            fault::check("after-snapshot")?;
            let t_wait = Instant::now();
            let ran_on = before_run_on();
            let waited = t_wait.elapsed();
            // Everything is read: the processes run on while the copies of
            // their memory are stored (a dump that continues them holds no
            // socket in repair mode; the network lock of a coordinated
            // checkpoint stays: it holds their connections until FINISH).
            tree::let_go(std::mem::take(&mut self.procs), Action::Continue)?;
            self.thawed_after = Some(self.frozen_at.elapsed());
            debug!(
                root = self.root,
                frozen_ms = self.frozen_at.elapsed().as_millis() as u64,
                capture_ms = captured.as_millis() as u64,
                waited_ms = waited.as_millis() as u64,
                "tree runs again; storing its memory (capture: its state read; waited: for the others)"
            );
            ran_on();
            memory::store_snapshots(&mut d, &mut images)?;
        }
        let stored = t_dump.elapsed();
        let read = d.read;
        let trackers = memory::take_trackers(&mut d.stash);
        let borrowed = d.stash.take::<memory::Borrowed>().unwrap_or_default();
        let (objects, held) = d.objects.finish();
        let store = store.finish(opts.fsync())?;
        let root = self.root;
        // The lock is recorded only when it outlives the dump (the processes
        // end); cr_restart removes it.
        let netlock = match &self.lock {
            Some(l) if opts.action() != Action::Continue => l.image_name(),
            _ => None,
        };
        let cgroup_dirs = self.cgroup_dirs.clone();
        let mut ck = Checkpoint {
            meta: meta(root, &self.image_id, &images),
            root_pid: root as u32,
            pidns: tree::pidns_root(root)?,
            processes: images,
            objects,
            netlock,
            parent: parent_ref(&self.dir, self.parent.as_ref().map(|c| c.top())),
            store: Some(store),
            pre_dump: false,
            sysv,
            mounts,
            job_dir: job_dir(root).map(|d| d.display().to_string()),
            uts,
            cgroupns,
            netns,
            outside_files,
            cgroup_dirs,
            cgroup_frames,
        };
        fault::check("before-commit")?;
        self.dir.commit(&mut ck, opts.fsync())?;
        debug!(
            root,
            capture_ms = captured.as_millis() as u64,
            store_ms = (stored - captured).as_millis() as u64,
            commit_ms = (t_dump.elapsed() - stored).as_millis() as u64,
            ran_on = self.thawed_after.is_some(),
            "image written (capture: state read while frozen; store: memory copied out stored; commit: page store, image, fsyncs)"
        );
        let frozen = self.frozen_for();
        let summary = summarize(root, &ck, read, frozen, self.t0);
        Ok(Dumped {
            summary,
            held,
            kept: trackers.kept,
            released: trackers.released,
            borrowed,
            files: data_files(&ck),
        })
    }

    /// `--verify` after [`Held::dump`], the processes still frozen: capture
    /// them again and compare with the image as written (read back from
    /// its directory); a difference is an error (dropping the `Held` then
    /// removes the image and lets the processes run on).
    pub fn verify(&mut self) -> Result<std::time::Duration, CheckpointError> {
        if self.procs.is_empty() {
            return Err(CheckpointError::Verify(
                "the processes ran on before their memory was stored; nothing to compare".into(),
            ));
        }
        let ck = self.dir.read_checkpoint()?;
        let v =
            crate::verify::tree(&ck, &mut self.procs, &self.dir, false, false).map_err(|e| {
                CheckpointError::Verify(format!(
                    "cannot capture the tree again: {}",
                    cr_sys::error::one_line(&e)
                ))
            })?;
        info!(
            root = self.root,
            us = v.elapsed.as_micros() as u64,
            "tree verified against its image"
        );
        match v.difference {
            Some(d) => Err(CheckpointError::Verify(d)),
            None => Ok(v.elapsed),
        }
    }

    /// Let the processes go after [`Held::dump`]: run on, stop or die.
    pub fn finish(mut self, action: Action) -> Result<(), CheckpointError> {
        // Dropped with the image still in `dumped`: the checkpoint is undone.
        fault::check("after-commit")?;
        if self.thawed_after.is_some() && action != Action::Continue {
            return Err(CheckpointError::unsupported(
                self.root,
                "the processes already run on (their memory was copied out): they cannot be stopped or killed with the checkpoint",
            ));
        }
        // VmFlags taken from before the freeze (see `memory::flags`): read
        // again now, exactly, when the processes stay frozen to the end;
        // once they run again otherwise. A difference undoes the image
        // (here by the drop).
        let runs_on = action == Action::Continue || self.thawed_after.is_some();
        if !runs_on {
            if let Some(d) = &self.dumped {
                d.borrowed.check()?;
            }
        }
        let Some(d) = self.dumped.take() else {
            return Err(CheckpointError::unsupported(
                self.root,
                "the processes cannot be let go before their image is written",
            ));
        };
        // A lock kept for a dump that ends the processes belongs to the
        // image: cr_restart removes it. After a CONTINUE it goes now.
        if let Some(l) = self.lock.take() {
            if action != Action::Continue {
                l.keep();
            }
        }
        for h in d.held {
            if action == Action::Kill {
                h.keep(); // closed in repair mode by the kill: no FIN, no RST
            }
        }
        tree::let_go(std::mem::take(&mut self.procs), action)?;
        if runs_on {
            if let Err(e) = d.borrowed.check() {
                // The drop tells libcr it failed and lets the rest go.
                self.dir.undo(&d.files);
                return Err(e);
            }
        }
        after_commit(&self.dir, &self.image_id, self.parent.as_ref(), &d.kept);
        if let Some(c) = self.coop.take() {
            c.finish();
        }
        self.dir.settle(&d.files);
        drop(d.released);
        info!(
            root = self.root,
            processes = d.summary.processes,
            bytes = d.summary.page_bytes,
            stored = d.summary.store_bytes,
            frozen_ms = self.frozen_for().as_millis() as u64,
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
            drop(d.held);
            self.dir.undo(&d.files);
        } else {
            self.dir.abandon();
        }
        drop(self.lock.take());
        for f in std::mem::take(&mut self.procs).into_iter().rev() {
            drop(f);
        }
        debug!(root = self.root, "checkpoint aborted; the processes run on");
    }
}

/// After a commit: record the trackers left running and the new image as
/// a dependant of its parent.
fn after_commit(
    dir: &ImageDir,
    image_id: &str,
    parent: Option<&Chain>,
    kept: &[(i32, DirtyMethod, i32)],
) {
    for &(pid, method, fd) in kept {
        tracking::save(pid, method, fd, image_id);
    }
    if let Some(p) = parent {
        if let Err(e) = chain::add_dependant(p.top().dir.path(), dir.path(), image_id) {
            tracing::warn!(error = %cr_sys::error::one_line(&e), "cannot record the new image as a dependant of its parent");
        }
    }
}

fn parent_ref(dir: &ImageDir, parent: Option<&Link>) -> Option<ParentRef> {
    parent.map(|p| ParentRef {
        path: chain::relative_path(dir.path(), p.dir.path()),
        image_id: p.ck.meta.image_id.clone(),
    })
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Where and by what the image is taken.
fn meta(root: i32, image_id: &str, images: &[Process]) -> Meta {
    let cpu_xfeatures = images
        .iter()
        .flat_map(|p| p.threads.iter())
        .map(|t| cr_sys::regs::xstate_xfeatures(&t.xstate).unwrap_or(0))
        .fold(0, |a, b| a | b);
    Meta {
        tool_version: env!("CARGO_PKG_VERSION").to_string(),
        created_unix_ms: now_ms(),
        hostname: proc::sys_value("/proc/sys/kernel/hostname"),
        kernel_release: proc::sys_value("/proc/sys/kernel/osrelease"),
        boot_id: proc::sys_value("/proc/sys/kernel/random/boot_id"),
        netns: proc::read_link(&format!("/proc/{root}/ns/net")).unwrap_or_default(),
        cpu_xfeatures,
        image_id: image_id.to_string(),
        vdso_build_id: kinds::memory::vdso::build_id_of(root).unwrap_or_default(),
    }
}

fn summarize(root: i32, ck: &Checkpoint, read: u64, frozen: Duration, t0: Instant) -> Summary {
    let live = || ck.processes.iter().filter(|p| !p.is_zombie());
    Summary {
        pid: root,
        processes: ck.processes.len(),
        threads: ck.processes.iter().map(|p| p.threads.len()).sum(),
        page_bytes: read,
        store_bytes: ck.store.as_ref().map_or(0, |s| s.size),
        pages_parent: live().map(|p| p.memory.stats.pages_parent).sum(),
        dirty: ck
            .processes
            .first()
            .map_or(DirtyMethod::Full, |p| p.memory.dirty),
        vmas: ck.processes.iter().map(|p| p.vmas.len()).sum(),
        fds: ck.processes.iter().map(|p| p.fds.len()).sum(),
        frozen,
        elapsed: t0.elapsed(),
    }
}

/// Pre-dump: freeze the tree only to list its mappings and start dirty
/// tracking (the memory kind's plan), then copy memory while it runs.
pub fn pre_dump(root: i32, opts: &CheckpointOptions) -> Result<Summary, CheckpointError> {
    let t0 = Instant::now();
    tree::validate(root)?;
    let path = opts.image_dir(root);
    let method = tracking::method(opts.dirty)?;
    let parent = open_parent(opts, &path)?;
    chain::check_overwrite(&path)?;
    let dir = ImageDir::create(&path)?;
    let image_id = cr_image::new_image_id();
    let result = (|| {
        let store = StoreWriter::create(&dir, &image_id[..16], opts.compress)?;
        let mut d = Dump {
            opts,
            dir: &dir,
            store: Some(&store),
            parent: parent.as_ref().map(|c| c.top()),
            method,
            image_id: &image_id,
            fds: TreeFds::default(),
            objects: Objects::new(None, &image_id, opts.fsync()),
            stash: Stash::default(),
            read: 0,
            arena: None,
            early: None,
        };
        let mut procs = tree::freeze(root)?;
        let frozen_at = Instant::now();
        let mut work = Vec::new();
        for f in procs.iter_mut().filter(|f| f.zombie.is_none()) {
            let pid = f.pid;
            let sys = |e| CheckpointError::from_sys(pid, e);
            let mut p = Process::default();
            let mut cx = Proc::open(f, &mut d, &mut p, false)?;
            let plan = memory::plan_process(&mut cx, &mut p, true)?;
            cx.probe.close().map_err(sys)?;
            work.push((p, plan));
        }
        fault::check("pre-dump-frozen")?;
        // The processes run on from here; their memory is copied meanwhile.
        for f in procs.into_iter().rev() {
            drop(f);
        }
        let frozen = frozen_at.elapsed();
        let mut images = Vec::with_capacity(work.len());
        for (mut p, plan) in work {
            interrupt::check().map_err(CheckpointError::Interrupted)?;
            memory::copy_process(&mut d, &mut p, plan)?;
            images.push(p);
        }
        let read = d.read;
        let trackers = memory::take_trackers(&mut d.stash);
        let store = store.finish(opts.fsync())?;
        let mut ck = Checkpoint {
            meta: meta(root, &image_id, &[]),
            root_pid: root as u32,
            pidns: false,
            processes: images,
            objects: Vec::new(),
            netlock: None,
            parent: parent_ref(&dir, parent.as_ref().map(|c| c.top())),
            store: Some(store),
            pre_dump: true,
            sysv: None,
            mounts: None,
            job_dir: None,
            uts: None,
            cgroupns: None,
            netns: None,
            outside_files: Vec::new(),
            cgroup_dirs: Vec::new(),
            cgroup_frames: Vec::new(),
        };
        fault::check("before-commit")?;
        dir.commit(&mut ck, opts.fsync())?;
        dir.settle(&data_files(&ck));
        after_commit(&dir, &image_id, parent.as_ref(), &trackers.kept);
        drop(trackers.released);
        info!(
            root,
            frozen_ms = frozen.as_millis() as u64,
            "pre-dump committed"
        );
        Ok(summarize(root, &ck, read, frozen, t0))
    })();
    if result.is_err() {
        dir.abandon();
    }
    result
}

/// The process to checkpoint when the user names `pid`: for a `cr_run`
/// launcher, the job it runs (its only child, PID 1 of the job's
/// namespace); the same for a `cr_restart` waiting for what it restored.
pub fn job_root(pid: i32) -> i32 {
    match proc::children(pid) {
        Ok(kids) if is_launcher(pid) && kids.len() == 1 => kids[0],
        _ => pid,
    }
}

/// Whether `pid` runs `cr_run` or `cr_restart` (a job's launcher).
fn is_launcher(pid: i32) -> bool {
    proc::read_link(&format!("/proc/{pid}/exe"))
        .map(|e| matches!(e.rsplit('/').next(), Some("cr_run" | "cr_restart")))
        .unwrap_or(false)
}

/// The records of `cr_run` jobs: the directory each was started with.
const JOBS: crate::pidstate::PidState = crate::pidstate::PidState("jobs");

/// The image directory job `pid` (the root of a `cr_run` job, or of one
/// restored from its image) was started with (`cr_run --dir`), as recorded
/// by cr_run or by the restore: never taken from the job's environment,
/// which programs rewrite.
pub fn job_dir(pid: i32) -> Option<PathBuf> {
    // A job that has just started may not be recorded yet (its cr_run
    // writes the record after the fork, while the job already runs); its
    // cr_run records itself before it forks.
    let text = JOBS.read(pid).or_else(|| {
        let ppid = proc::stat(pid).ok()?.ppid;
        is_launcher(ppid).then(|| JOBS.read(ppid)).flatten()
    })?;
    let dir = text.trim_end_matches('\n');
    dir.starts_with('/').then(|| PathBuf::from(dir))
}

/// Record `dir` as the image directory of job `pid` (absolute); returns
/// the record, which the caller removes when the job ends.
pub fn record_job(pid: i32, dir: &std::path::Path) -> Option<PathBuf> {
    match JOBS.write(pid, &format!("{}\n", dir.display())) {
        Ok(path) => {
            debug!(pid, record = %path.display(), "job recorded");
            Some(path)
        }
        Err(e) => {
            tracing::warn!(pid, error = %e, "cannot record the job's directory; its checkpoints need --dir");
            None
        }
    }
}
