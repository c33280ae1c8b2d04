//! The restore of an image, start to finish.
//!
//! 1. [`prepare`]: read the image and its chain (every value checked by
//!    `cr_image::model`), refuse what cannot be restored here (the caller's
//!    rights, PIDs taken, the CPU, the vDSO), let every file kind create
//!    its objects in the restorer ([`crate::kinds::FileKind::prepare`]:
//!    pipes, sockets, file contents, ptys), then create the stubs of the
//!    tree (`kinds::tree::restore`) and rebuild each process ([`rebuild`]),
//!    kind by kind, in a fixed order.
//! 2. [`Ready::release`]: the file kinds' last steps (timers armed,
//!    connections out of repair mode, the network lock removed), then every
//!    thread runs at once.
//!
//! Nothing of the image runs before the release: a failure anywhere (or
//! dropping the [`Ready`]) kills every stub and leaves nothing behind.

use crate::error::{RestoreError, StepContext};
use crate::kinds::memory::{self, Pages};
use crate::kinds::seccomp::When;
use crate::kinds::tree::restore::Ids;
use crate::kinds::tree::Frozen;
use crate::kinds::{self, Kind, Stash, FILE_KINDS};
use crate::options::RestoreOptions;
use crate::stub::Stub;
use cr_image::chain::{Chain, Piece};
use cr_image::model::{Checkpoint, ProcState, Process, SeccompMode};
use cr_image::ImageDir;
use cr_sys::proc;
use cr_sys::ptrace::{wait_raw, Tracee};
use cr_sys::remote::{find_syscall_insn, Injector};
use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};
use tracing::{debug, info};

/// How long the steps of one restore took, logged once the tree is rebuilt
/// (`restore steps`): where a migration's restore goes.
struct Steps {
    t: Instant,
    done: Vec<(&'static str, Duration)>,
}

impl Steps {
    fn start() -> Self {
        Steps {
            t: Instant::now(),
            done: Vec::new(),
        }
    }

    /// Step `what` ends now.
    fn mark(&mut self, what: &'static str) {
        let now = Instant::now();
        self.done.push((what, now - self.t));
        self.t = now;
    }
}

impl std::fmt::Display for Steps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (k, (what, d)) in self.done.iter().enumerate() {
            let sep = if k == 0 { "" } else { ", " };
            write!(f, "{sep}{what} {:.1}", d.as_secs_f64() * 1e3)?;
        }
        Ok(())
    }
}

impl std::fmt::Display for RebuildTimes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        write!(
            f,
            "memory {:.1} (maps {:.1}, pages now {:.1}, userfaultfd {:.1}), fds {:.1}",
            ms(self.memory),
            ms(self.maps),
            ms(self.pages_now),
            ms(self.lazy),
            ms(self.fds)
        )
    }
}

/// Time spent in the main kinds of [`rebuild`], over every process.
#[derive(Default)]
pub(crate) struct RebuildTimes {
    pub memory: Duration,
    /// Of `memory`: the mappings made, the pages written before the
    /// release (those a lazy restore cannot leave for later, waited for
    /// when they come from another node), the userfaultfds set up.
    pub maps: Duration,
    pub pages_now: Duration,
    pub lazy: Duration,
    pub fds: Duration,
}

/// What the rebuild of every process of one restore shares.
pub struct Restorer<'a> {
    pub ck: &'a Checkpoint,
    pub opts: &'a RestoreOptions,
    pub img: &'a ImageDir,
    pub ids: Ids,
    /// What the kinds hold in the restorer (objects, timers to arm...).
    pub stash: Stash,
    /// The restorer's pidfd, inherited by every stub, through which the
    /// stubs take their fds (`Stub::grab`).
    pub grab_pidfd: i32,
}

/// One process being rebuilt: its stub (which lives as long as the
/// tracee it drives, `'t`: a rebuild may be left half done while others
/// go on, see [`rebuild_start`]) and what the kinds need.
pub struct Rebuild<'s, 'r, 't> {
    pub stub: Stub<'t>,
    pub r: &'s mut Restorer<'r>,
    pub pages: &'s Pages<'s>,
    /// Where every page of the process is.
    pub pieces: &'s [Piece],
    pub is_root: bool,
    /// The process's other threads, once created (`kinds::threads`).
    pub threads: Vec<Tracee>,
    /// Whether the memory kind leaves its page fill to the caller
    /// ([`memory::Deferred`] in `fill`) instead of filling at once.
    pub defer_fill: bool,
    pub fill: Option<memory::Deferred>,
}

impl<'s, 'r, 't> Rebuild<'s, 'r, 't> {
    fn new(
        stub: Stub<'t>,
        r: &'s mut Restorer<'r>,
        pages: &'s Pages<'s>,
        pieces: &'s [Piece],
        p: &Process,
        defer_fill: bool,
    ) -> Self {
        let is_root = p.pid == r.ck.root_pid;
        Rebuild {
            stub,
            r,
            pages,
            pieces,
            is_root,
            threads: Vec::new(),
            defer_fill,
            fill: None,
        }
    }
}

/// Restore the image in `dir`: the whole process tree, every process with
/// its PID and every thread with its TID. The root runs again as a child of
/// the caller when this returns its PID (with `--lazy-pages`, once every
/// page is in too; see [`Ready::take_lazy`] to return at once).
pub fn restore(dir: &Path, opts: &RestoreOptions) -> Result<i32, RestoreError> {
    let mut ready = prepare(dir, opts)?;
    let lazy = ready.take_lazy();
    let pid = ready.release()?;
    lazy.wait()?;
    Ok(pid)
}

/// A restored tree, complete but not yet running: every thread is held by
/// the caller's thread (ptrace), so [`Ready::release`] must be called from
/// the same thread. Dropping it kills every process of the tree.
pub struct Ready {
    ck: Checkpoint,
    opts: RestoreOptions,
    img: ImageDir,
    root_pid: i32,
    ids: Ids,
    stash: Stash,
    /// One per process of the image, in its order.
    stubs: Vec<Tracee>,
    /// The other threads of each process.
    threads: Vec<Vec<Tracee>>,
    /// The restorer's pidfd the stubs took their fds through.
    me: OwnedFd,
    /// The groups the restore made, removed if it fails: last, so that
    /// a `Ready` dropped unreleased kills its stubs first.
    cgroups_made: kinds::cgroups::Leftovers,
}

impl Ready {
    /// PID of the root (in the caller's PID namespace).
    pub fn pid(&self) -> i32 {
        self.root_pid
    }

    /// The image's directory.
    pub fn image_dir(&self) -> &Path {
        self.img.path()
    }

    /// The image's root PID.
    pub fn image_pid(&self) -> i32 {
        self.ck.root_pid as i32
    }

    /// The outside files named to be saved (`--save-file`) whose content
    /// the image holds, by path: the restored member's next checkpoints
    /// save them again. (Files saved only because they were open, with
    /// `--save-files`, are not named: they may be gone by then.)
    pub fn saved_files(&self) -> Vec<String> {
        self.ck
            .outside_files
            .iter()
            .filter(|f| f.saved.is_some() && f.listed)
            .map(|f| f.path.clone())
            .collect()
    }

    /// The image's network lock, handed to the caller, which removes it
    /// itself (several images' at once: see `cr_sys::netlock::unlock_many`)
    /// before calling [`Ready::release`].
    pub fn take_netlock(&mut self) -> Option<String> {
        self.ck.netlock.take()
    }

    /// The post-copy transfers (`--lazy-pages`), running already; the
    /// caller keeps them until every page is in ([`memory::lazy::Transfer::wait`])
    /// once the tree is released. Dropped, they kill the processes.
    pub fn take_lazy(&mut self) -> memory::lazy::Transfer {
        self.stash
            .take::<memory::lazy::Transfer>()
            .unwrap_or_default()
    }

    /// Let every process run, all at once; the root's PID.
    pub fn release(mut self) -> Result<i32, RestoreError> {
        let mut cgroups_made = std::mem::take(&mut self.cgroups_made);
        let released = self.release_tree();
        if released.is_ok() {
            cgroups_made.keep();
        }
        // Dropped now, on a failure after every stub is gone.
        drop(cgroups_made);
        released
    }

    /// [`Ready::release`] but for the groups.
    fn release_tree(self) -> Result<i32, RestoreError> {
        let Ready {
            ck,
            opts,
            img,
            root_pid,
            ids,
            stash,
            stubs,
            threads,
            me,
            cgroups_made: _,
        } = self;
        let t0 = Instant::now();
        let mut r = Restorer {
            ck: &ck,
            opts: &opts,
            img: &img,
            ids,
            stash,
            grab_pidfd: me.as_raw_fd(),
        };
        // Every thread of every process is ready and nothing of the tree
        // has run yet. The image's network lock (same host, same namespace)
        // goes now that every connection exists again; then the file kinds
        // finish (connections leave repair mode, timers start).
        kinds::netlock::remove(ck.netlock.as_deref());
        for k in FILE_KINDS {
            k.release(&mut r)?;
        }
        kinds::sysv::release(&mut r, root_pid)?;
        if opts.shell_job {
            kinds::tty::take_terminal(root_pid);
        }
        kinds::tree::restore::release(&ck.processes, stubs, threads)?;
        if let Some(d) = &ck.job_dir {
            crate::capture::record_job(root_pid, Path::new(d));
        }
        if !opts.restart_callbacks_later {
            crate::coop::restarted(root_pid, img.path());
        }
        info!(
            root = root_pid,
            processes = ck.processes.len(),
            pidns = r.ids.pidns,
            ms = format!("{:.1}", t0.elapsed().as_secs_f64() * 1e3),
            "restored tree released"
        );
        Ok(root_pid)
    }
}

/// Rebuild the tree of the image in `dir`, every process frozen (see [`Ready`]).
pub fn prepare(dir: &Path, opts: &RestoreOptions) -> Result<Ready, RestoreError> {
    let steps = Steps::start();
    let chain = Chain::open(dir)?;
    prepare_chain(dir, chain, steps, opts)
}

/// [`prepare`] of the image at `dir`, its chain already open (read once
/// by a caller that looked at the image first).
pub fn prepare_opened(
    dir: &Path,
    chain: Chain,
    opts: &RestoreOptions,
) -> Result<Ready, RestoreError> {
    prepare_chain(dir, chain, Steps::start(), opts)
}

fn prepare_chain(
    dir: &Path,
    chain: Chain,
    mut steps: Steps,
    opts: &RestoreOptions,
) -> Result<Ready, RestoreError> {
    let img = chain.top().dir.clone();
    let mut ck = chain.top().ck.clone();
    if ck.pre_dump {
        return Err(RestoreError::PreDump(dir.to_path_buf()));
    }
    kinds::identity::check_caller(&ck.processes)?;
    if proc::own_ids().1 != 0 {
        let (uid, _, gid, _) = proc::own_ids();
        kinds::sysv::check_owner(&ck, uid, gid)?;
    }
    let pages = Pages::open(&chain, opts.remote_pages.as_ref())?;
    let mut pieces: HashMap<u32, Vec<Piece>> = HashMap::new();
    for p in ck.processes.iter().filter(|p| !p.is_zombie()) {
        // A broken chain found now costs nothing; blocks are checked as
        // they are used.
        pieces.insert(p.pid, pages.resolve(p.pid)?);
    }
    steps.mark("image");
    let ids = Ids::new(&ck);
    ids.check_free(&ck)?;
    kinds::sysv::check(&ck)?;
    kinds::memory::vdso::check(&ck)?;
    kinds::threads::check_affinity(&ck.processes, &cr_sys::sched::online_cpus()?)?;
    // The groups first: a process may hold files in one the restore makes.
    kinds::cgroups::place(&mut ck, opts.cgroups, &opts.cgroup_root)?;
    // Declared before the stubs: dropped after them when the restore
    // fails, it removes the groups the restore made.
    let mut cgroups_made = kinds::cgroups::Leftovers::before(&ck)?;
    kinds::cgroups::dirs::make(&ck)?;
    kinds::outside::check(&ck, &img, opts)?;
    kinds::inet::warn_other_netns(&ck);
    raise_fd_limit();
    interrupt_check()?;
    let me = cr_sys::fdio::pidfd_open(std::process::id() as i32)?;
    let mut r = Restorer {
        ck: &ck,
        opts,
        img: &img,
        ids,
        stash: Stash::default(),
        grab_pidfd: me.as_raw_fd(),
    };
    steps.mark("checks");
    // Pipes, sockets and file contents first, in the restorer.
    for k in FILE_KINDS {
        k.prepare(&mut r, &ck)?;
    }
    steps.mark("files");
    // Stubs, parents before children, with sessions and groups; each
    // fills the memory it shares copy-on-write before it forks.
    let mut phases = Phases::default();
    let t_stubs = Instant::now();
    let mut cow = memory::cow::Cow::new(&ck, &pages, &pieces, opts.workers(), opts.lazy_pages);
    cow.open_files(&mut r)?;
    let mut stubs = kinds::tree::restore::spawn(
        &ck,
        &mut r.ids,
        opts.shell_job,
        &mut |i: usize, t: &mut Tracee| {
            interrupt_check()?;
            cow.before_fork(i, t)
        },
    )?;
    *r.stash.get::<memory::cow::Placed>() = cow.into_placed();
    steps.mark("stubs");
    phases.stubs = t_stubs.elapsed();
    // What the whole tree shares, in its namespaces: host name, mounts
    // (and ptys), IPC objects.
    kinds::uts::prepare(&ck, &mut stubs[0])?;
    kinds::mounts::prepare(&mut r, &mut stubs[0])?;
    kinds::sysv::prepare(&mut r, stubs[0].tid())?;
    steps.mark("namespaces");
    let mut threads: Vec<Vec<Tracee>> = ck.processes.iter().map(|_| Vec::new()).collect();
    let t_rebuild = Instant::now();
    rebuild_all(
        &ck,
        &mut r,
        &mut stubs,
        &mut threads,
        &pages,
        &pieces,
        opts,
        &mut phases,
    )?;
    open_deferred(&ck, &mut r, &mut stubs, &pages, &pieces)?;
    let rebuilt = t_rebuild.elapsed();
    kinds::tty::hang_up(&mut r);
    steps.mark("processes");
    // Every process took what it holds in /proc/PID of a process that had
    // exited: those directories are gone again before `--verify` looks.
    kinds::files::ghost::end_holders(&mut r);
    kinds::files::relink::end_names(&mut r);
    // Of "processes".
    let kinds = r.stash.take::<RebuildTimes>().unwrap_or_default();
    if opts.verify {
        let t = Instant::now();
        verify(&ck, &img, &mut stubs, &mut threads, opts.tcp_close)?;
        phases.verify = t.elapsed();
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    info!(
        processes = ck.processes.len(),
        stubs_ms = ms(phases.stubs),
        rebuild_ms = ms(rebuilt),
        start_ms = ms(phases.start),
        handed = phases.handed,
        hand_over_ms = ms(phases.hand_over),
        clean_ms = ms(phases.clean),
        clean_wait_ms = ms(phases.clean_wait),
        tail_ms = ms(phases.tail),
        tail_wait_ms = ms(phases.tail_wait),
        fill_ms = ms(phases.fill),
        fill_wait_ms = ms(phases.fill_wait),
        fds_ms = ms(phases.fds),
        threads_ms = ms(phases.threads),
        other_ms = ms(phases.other),
        verify_ms = ms(phases.verify),
        "tree rebuilt (fill: summed over processes, overlaps the rest)"
    );
    crate::fault::check_restore("restore-rebuilt")?;
    info!(
        image = %img.path().display(),
        processes = ck.processes.len(),
        lazy_pages = opts.lazy_pages,
        ms = %steps,
        processes_ms = %kinds,
        "restore steps"
    );
    let Restorer { ids, stash, .. } = r;
    Ok(Ready {
        root_pid: stubs[0].tid(),
        opts: opts.clone(),
        img: img.clone(),
        ids,
        stash,
        stubs,
        threads,
        me,
        ck,
        cgroups_made: std::mem::take(&mut cgroups_made),
    })
}

/// Rebuild every process of the tree in the image's order. Our thread,
/// the tracer of every stub (ptrace ties a tracee to the thread that
/// seized it), makes the injected calls of every step that needs the
/// restorer's shared state or an order between processes; the pages of a
/// process are written by the worker pool (`process_vm_writev` needs no
/// ptrace) while this thread goes on with the next processes, at most
/// `workers` processes ahead. The rest of a process's rebuild waits for
/// its own pages: nothing after its mappings touches them, and no later
/// process needs anything of its rest (their mappings only need the
/// files and shared memory objects already made).
///
/// The first step of a process, its stub emptied ([`clean`]: about a
/// third of the injected calls, mostly waits for the stub to run and stop
/// again), needs neither: the stubs but the first, whose fd table no
/// other process shares, are handed over ([`Stub::park`]) to a few
/// cleaner threads (one per worker, at most 4) that empty them at the same time, each tracing its
/// own, and hand them back. A failure returns once every fill started
/// has ended and the cleaners are done; the caller then kills every
/// stub, whichever thread held it last (a parked stub is killed by its
/// `Tracee`'s drop, and a stub parked when we die gets the parent-death
/// signal SIGKILL set before it is handed over).
#[allow(clippy::too_many_arguments)]
fn rebuild_all(
    ck: &Checkpoint,
    r: &mut Restorer<'_>,
    stubs: &mut [Tracee],
    threads: &mut [Vec<Tracee>],
    pages: &Pages<'_>,
    pieces: &HashMap<u32, Vec<Piece>>,
    opts: &RestoreOptions,
    phases: &mut Phases,
) -> Result<(), RestoreError> {
    // A single process gains nothing (its fill uses every worker), and
    // post-copy pages are placed by the memory kind itself.
    let defer = !opts.lazy_pages && ck.processes.len() > 1;
    let workers = opts.workers();
    let ahead = workers.clamp(1, 8);
    let progress = opts.progress;
    let pieces_of = |p: &Process| pieces.get(&p.pid).map_or(&[][..], |v| v.as_slice());
    let first_live = ck.processes.iter().position(|p| !p.is_zombie());
    let cleaners = if defer {
        workers.clamp(1, MAX_CLEANERS)
    } else {
        0
    };
    let handed: Vec<bool> = ck
        .processes
        .iter()
        .enumerate()
        .map(|(i, p)| {
            cleaners > 0
                && Some(i) != first_live
                && !p.is_zombie()
                && p.fd_table_of.is_none()
                && !ck.processes.iter().any(|q| q.fd_table_of == Some(p.pid))
                // A process that had unmapped its [vdso]: its calls move
                // from the parked vDSO to its own code
                // (`memory::vdso::unmap_parked`), where a `pause` to park
                // it in faulted. Kept on this thread.
                && p
                    .vmas
                    .iter()
                    .any(|v| v.kind == cr_image::model::VmaKind::Vdso)
        })
        .collect();
    // Its last steps too when they need no order: no fs information
    // shared, and no seccomp state, which the last steps install before
    // the stub is parked again in `pause`. The kernel judges a system call
    // by seccomp after the tracer's syscall-entry stop, where a parked
    // stub is let go; suspending seccomp (PTRACE_O_SUSPEND_SECCOMP) ends
    // with the detach, so strict mode, or a filter refusing `pause`, kills
    // the stub (zdtm seccomp_strict).
    let tail: Vec<bool> = ck
        .processes
        .iter()
        .enumerate()
        .map(|(i, p)| {
            handed[i]
                && p.fs_of.is_none()
                && !ck.processes.iter().any(|q| q.fs_of == Some(p.pid))
                && p.threads
                    .iter()
                    .all(|t| t.seccomp.mode == SeccompMode::None)
        })
        .collect();
    let options = kinds::tree::restore::stub_options(&r.ids);
    let grab_pidfd = r.grab_pidfd;
    let (ck_r, opts_r, img_r) = (r.ck, r.opts, r.img);
    let ids_r = &r.ids;
    let kept: Vec<Vec<(u64, u64)>> = ck
        .processes
        .iter()
        .map(|p| r.stash.get::<memory::cow::Placed>().ranges(p.pid))
        .collect();
    let mut slots: Vec<Option<&mut Tracee>> = stubs.iter_mut().map(Some).collect();
    let (job_tx, job_rx) = mpsc::channel::<Job<'_>>();
    let job_rx = Mutex::new(job_rx);
    let (done_tx, done_rx) = mpsc::channel::<Done<'_>>();
    let abort = AtomicBool::new(false);
    type Filled = (memory::Deferred, Duration, Result<u64, RestoreError>);
    let ids_copy: Vec<Ids> = (0..cleaners).map(|_| ids_r.clone()).collect();
    std::thread::scope(|s| {
        for ids in ids_copy {
            let done_tx = done_tx.clone();
            let (job_rx, abort, kept) = (&job_rx, &abort, &kept);
            s.spawn(move || {
                // The restorer as the last steps see it: the image and
                // the ids (they use nothing of its stash).
                let mut lr = Restorer {
                    ck: ck_r,
                    opts: opts_r,
                    img: img_r,
                    ids,
                    stash: Stash::default(),
                    grab_pidfd,
                };
                loop {
                    let job = job_rx
                        .lock()
                        .map_err(|_| ())
                        .and_then(|rx| rx.recv().map_err(|_| ()));
                    let Ok(job) = job else {
                        return;
                    };
                    if abort.load(Ordering::Relaxed) {
                        // Dropped parked: killed with the others.
                        continue;
                    }
                    let t = Instant::now();
                    let done = match job {
                        Job::Clean(i, mut b) => {
                            let res = b
                                .stub
                                .unpark(options)
                                .map_err(RestoreError::from)
                                .and_then(|()| {
                                    clean(&mut b, ck, &ck.processes[i], grab_pidfd, &kept[i])
                                })
                                .and_then(|()| Ok(b.stub.park()?));
                            Done::Cleaned(i, t.elapsed(), res.map(|()| b))
                        }
                        Job::Tail(i, mut stub) => {
                            let p = &ck.processes[i];
                            let res = stub.unpark(options).map_err(RestoreError::from);
                            let res = res.and_then(|()| {
                                let mut cx =
                                    Rebuild::new(stub, &mut lr, pages, pieces_of(p), p, false);
                                rebuild_tail(&mut cx, p)?;
                                cx.stub.park()?;
                                Ok(cx.stub)
                            });
                            Done::Tailed(i, t.elapsed(), res)
                        }
                    };
                    let _ = done_tx.send(done);
                }
            });
        }
        drop(done_tx);
        let job_tx = job_tx;
        let res = (|| -> Result<(), RestoreError> {
            // Handed over first: the cleaners start at once, while this
            // thread rebuilds the first process.
            let t = Instant::now();
            for (i, slot) in slots.iter_mut().enumerate() {
                if !handed[i] {
                    continue;
                }
                interrupt_check()?;
                let Some(t) = slot.take() else { continue };
                let mut b = begin(t, ck)?;
                // Should we die while no thread of ours traces it.
                b.stub
                    .call(
                        "prctl(PR_SET_PDEATHSIG)",
                        libc::SYS_prctl,
                        [
                            libc::PR_SET_PDEATHSIG as u64,
                            libc::SIGKILL as u64,
                            0,
                            0,
                            0,
                            0,
                        ],
                    )
                    .step(|| {
                        format!("cannot set the parent-death signal of stub {}", b.stub.pid)
                    })?;
                b.stub.park()?;
                let _ = job_tx.send(Job::Clean(i, b));
                phases.handed += 1;
            }
            phases.hand_over += t.elapsed();
            let mut cleaned: HashMap<usize, Result<Begun<'_>, RestoreError>> = HashMap::new();
            let mut tails_out = 0usize;
            let mut tailed: Vec<(usize, Result<Stub<'_>, RestoreError>)> = Vec::new();
            let take_done = |phases: &mut Phases,
                             cleaned: &mut HashMap<_, _>,
                             tailed: &mut Vec<_>|
             -> Result<(), RestoreError> {
                match done_rx.recv() {
                    Ok(Done::Cleaned(j, took, b)) => {
                        phases.clean += took;
                        cleaned.insert(j, b);
                    }
                    Ok(Done::Tailed(j, took, b)) => {
                        phases.tail += took;
                        tailed.push((j, b));
                    }
                    Err(_) => {
                        return Err(RestoreError::Unsupported(
                            "a stub handed over was not handed back".into(),
                        ))
                    }
                }
                Ok(())
            };
            let mut flight = VecDeque::new();
            let mut next = 0;
            loop {
                // A process begun while no more than `ahead` wait for their
                // fills, else the oldest one ended.
                if next < ck.processes.len() && flight.len() <= ahead {
                    let i = next;
                    next += 1;
                    let p = &ck.processes[i];
                    interrupt_check()?;
                    if p.is_zombie() {
                        continue;
                    }
                    let t0 = Instant::now();
                    let mut started = if handed[i] {
                        let mut b = loop {
                            if let Some(b) = cleaned.remove(&i) {
                                break b?;
                            }
                            take_done(phases, &mut cleaned, &mut tailed)?;
                        };
                        phases.clean_wait += t0.elapsed();
                        b.stub.unpark(options)?;
                        debug!(pid = b.stub.pid, "rebuilding (stub emptied by a cleaner)");
                        rebuild_maps(b.stub, r, p, pages, pieces_of(p), defer)?
                    } else {
                        let Some(t) = slots[i].take() else { continue };
                        debug!(pid = t.tid(), "rebuilding");
                        rebuild_start(t, r, p, pages, pieces_of(p), defer)?
                    };
                    phases.start += t0.elapsed();
                    let job = started.fill.take().map(|d| {
                        s.spawn(move || {
                            let t = Instant::now();
                            let res = d.fill(pages, workers, &progress);
                            (d, t.elapsed(), res)
                        })
                    });
                    flight.push_back((i, started, job));
                    if flight.len() > 1 {
                        // Tests: a failure with fills in flight and processes left.
                        crate::fault::check_restore("restore-mid-tree")?;
                    }
                    continue;
                }
                let Some((i, mut started, job)) = flight.pop_front() else {
                    break;
                };
                let p = &ck.processes[i];
                if let Some(job) = job {
                    let t = Instant::now();
                    let (d, took, res): Filled = job
                        .join()
                        .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
                    phases.fill_wait += t.elapsed();
                    phases.fill += took;
                    res?;
                    started.fill = Some(d);
                }
                debug!(pid = p.pid, "rebuilding the rest");
                if tail[i] {
                    let t = Instant::now();
                    let (fds0, threads0) = (phases.fds, phases.threads);
                    let (mut stub, others) =
                        rebuild_mid(started, r, p, pages, pieces_of(p), phases)?;
                    threads[i] = others;
                    stub.park()?;
                    let _ = job_tx.send(Job::Tail(i, stub));
                    tails_out += 1;
                    let own = (phases.fds - fds0) + (phases.threads - threads0);
                    phases.other += t.elapsed().saturating_sub(own);
                } else {
                    threads[i] = rebuild_end(started, r, p, pages, pieces_of(p), phases)?;
                }
            }
            // The last steps done by the cleaners: each stub back here,
            // its registers set.
            let t = Instant::now();
            while tailed.len() < tails_out {
                take_done(phases, &mut cleaned, &mut tailed)?;
            }
            phases.tail_wait += t.elapsed();
            for (i, stub) in tailed {
                let mut stub = stub?;
                stub.unpark(options)?;
                rebuild_finish(stub, &ck.processes[i], phases)?;
            }
            Ok(())
        })();
        // The cleaners end (those with stubs left drop them parked: killed).
        abort.store(res.is_err(), Ordering::Relaxed);
        drop(job_tx);
        res
    })
}

/// What is opened once every process of the tree is rebuilt: the pidfds
/// of threads of processes rebuilt after the process holding them, with
/// their copies and the epoll items watching them
/// (`kinds::eventfds::open_deferred`). Injected into each such process's
/// main thread, stopped where its rebuild left it (its registers, mask
/// and memory as they are once the calls are done), with scratch memory
/// for the while.
fn open_deferred(
    ck: &Checkpoint,
    r: &mut Restorer<'_>,
    stubs: &mut [Tracee],
    pages: &Pages<'_>,
    pieces: &HashMap<u32, Vec<Piece>>,
) -> Result<(), RestoreError> {
    for (p, t) in ck.processes.iter().zip(stubs.iter_mut()) {
        if p.is_zombie() || !kinds::eventfds::has_deferred(ck, p) {
            continue;
        }
        let filtered = p
            .threads
            .iter()
            .any(|t| t.seccomp.mode != SeccompMode::None);
        if filtered && !r.ids.seccomp_suspended {
            return Err(RestoreError::Unsupported(format!(
                "process {} holds pidfds of threads of processes rebuilt after it, and has a seccomp filter, which would judge the calls that open them (not supported)",
                p.pid
            )));
        }
        debug!(pid = p.pid, "opening the fds left for the end");
        let ip = find_syscall_insn(t.tid())?;
        let mut stub = Stub::new(Injector::new(t, ip)?);
        let scratch = stub
            .inj
            .mmap_anon(0, crate::stub::SCRATCH)
            .step(|| format!("cannot map scratch memory in process {}", p.pid))?;
        stub.scratch = scratch;
        let pieces = pieces.get(&p.pid).map_or(&[][..], |v| v.as_slice());
        let mut cx = Rebuild::new(stub, r, pages, pieces, p, false);
        kinds::eventfds::open_deferred(&mut cx, p)?;
        let mut stub = cx.stub;
        stub.call(
            "munmap",
            libc::SYS_munmap,
            [scratch, crate::stub::SCRATCH, 0, 0, 0, 0],
        )
        .step(|| "cannot unmap the restorer's scratch memory".into())?;
        stub.inj.finish()?;
    }
    Ok(())
}

/// A stub handed over to a cleaner thread ([`rebuild_all`]): to empty, or
/// for its last steps.
enum Job<'t> {
    Clean(usize, Begun<'t>),
    Tail(usize, Stub<'t>),
}

/// A stub a cleaner hands back, parked, with the time it took.
enum Done<'t> {
    Cleaned(usize, Duration, Result<Begun<'t>, RestoreError>),
    Tailed(usize, Duration, Result<Stub<'t>, RestoreError>),
}

/// The most threads that empty stubs beside the main tracer
/// ([`rebuild_all`]): one per worker (CPU) up to this. Each mostly waits
/// for its stub to run and stop again, but the stubs need the CPUs to
/// run their calls: with 2 CPUs at load 6-8, 2 cleaners rebuilt 32
/// processes in a median 185 ms, 1 in 220, 3 in 300 (as many as none).
const MAX_CLEANERS: usize = 4;

/// `--verify` (see [`crate::verify`]): the rebuilt tree, captured again
/// before anything of it runs, is its image.
fn verify(
    ck: &Checkpoint,
    img: &ImageDir,
    stubs: &mut Vec<Tracee>,
    threads: &mut Vec<Vec<Tracee>>,
    tcp_closed: bool,
) -> Result<(), RestoreError> {
    let mut procs: Vec<Frozen> = stubs
        .drain(..)
        .zip(threads.drain(..))
        .zip(&ck.processes)
        .map(|((stub, others), p)| Frozen {
            pid: stub.tid(),
            stopped: match p.state {
                ProcState::Stopped { signal } => Some(signal),
                _ => None,
            },
            zombie: p.is_zombie().then_some(0),
            tracees: std::iter::once(stub).chain(others).collect(),
        })
        .collect();
    let verdict = crate::verify::tree(ck, &mut procs, img, true, tcp_closed);
    // The same threads, back where the release expects them.
    for f in procs {
        let mut t = f.tracees.into_iter();
        stubs.extend(t.next());
        threads.push(t.collect());
    }
    let v = verdict.map_err(|e| {
        RestoreError::Verify(format!(
            "cannot capture the restored tree: {}",
            cr_sys::error::one_line(&e)
        ))
    })?;
    info!(
        processes = ck.processes.len(),
        us = v.elapsed.as_micros() as u64,
        "restored tree verified against its image"
    );
    match v.difference {
        Some(d) => Err(RestoreError::Verify(d)),
        None => Ok(()),
    }
}

fn interrupt_check() -> Result<(), RestoreError> {
    crate::interrupt::check().map_err(RestoreError::Interrupted)
}

/// One fd of ours per pipe, socket and file object, for a moment: as many
/// as the processes may have.
fn raise_fd_limit() {
    let me = std::process::id() as i32;
    if let Ok(limits) = cr_sys::limits::get_all(me) {
        if let Some(&(soft, hard)) = limits.get(libc::RLIMIT_NOFILE as usize) {
            if soft < hard {
                let _ = cr_sys::limits::set(me, libc::RLIMIT_NOFILE, hard, hard);
            }
        }
    }
}

/// Rebuild one process in its stub `tracee`, kind by kind; returns its
/// other threads (created, stopped).
pub fn rebuild(
    tracee: &mut Tracee,
    r: &mut Restorer<'_>,
    p: &Process,
    pages: &Pages<'_>,
    pieces: &[Piece],
) -> Result<Vec<Tracee>, RestoreError> {
    let started = rebuild_start(tracee, r, p, pages, pieces, false)?;
    rebuild_end(started, r, p, pages, pieces, &mut Phases::default())
}

/// A process whose rebuild stopped after its mappings were made (see
/// [`rebuild_start`]): its stub, and its pages to fill when deferred.
pub struct Started<'t> {
    stub: Stub<'t>,
    pub fill: Option<memory::Deferred>,
}

/// Where the time of a tree's restore went, summed over its processes
/// (logged once per restore, see [`prepare`]).
#[derive(Default, Debug)]
pub struct Phases {
    /// Stubs forked, sessions and groups, memory shared copy-on-write.
    pub stubs: Duration,
    /// Stub cleanup, mappings (injected calls, this thread), with the
    /// waits for stubs emptied by the cleaners.
    pub start: Duration,
    /// Stubs handed over to the cleaner threads, and the time it took.
    pub handed: usize,
    pub hand_over: Duration,
    /// Stubs emptied by the cleaners (summed over them; overlaps the
    /// rest), and waited for by this thread.
    pub clean: Duration,
    pub clean_wait: Duration,
    /// Last steps of processes run by the cleaners (summed), and the
    /// wait for the last of them.
    pub tail: Duration,
    pub tail_wait: Duration,
    /// Pages written (workers; overlaps the others when deferred).
    pub fill: Duration,
    /// Waited for a deferred fill to end.
    pub fill_wait: Duration,
    /// File descriptors.
    pub fds: Duration,
    /// Threads created, registers.
    pub threads: Duration,
    /// Every other step of a process (task, signals, timers, identity...).
    pub other: Duration,
    pub verify: Duration,
}

/// The first part of the rebuild of one process: the stub emptied, every
/// mapping made; with `defer_fill`, the pages are not written yet
/// ([`Started::fill`]: the caller writes them, from any thread, before
/// [`rebuild_end`]), else the memory is complete.
pub fn rebuild_start<'t>(
    tracee: &'t mut Tracee,
    r: &mut Restorer<'_>,
    p: &Process,
    pages: &Pages<'_>,
    pieces: &[Piece],
    defer_fill: bool,
) -> Result<Started<'t>, RestoreError> {
    let mut b = begin(tracee, r.ck)?;
    let kept = r.stash.get::<memory::cow::Placed>().ranges(p.pid);
    clean(&mut b, r.ck, p, r.grab_pidfd, &kept)?;
    rebuild_maps(b.stub, r, p, pages, pieces, defer_fill)
}

/// A stub with an injector, nothing of its process in it yet.
pub struct Begun<'t> {
    stub: Stub<'t>,
    own_rseq: cr_sys::ptrace::RseqConfig,
    ip: u64,
}

fn begin<'t>(tracee: &'t mut Tracee, ck: &Checkpoint) -> Result<Begun<'t>, RestoreError> {
    kinds::threads::check_cpu(ck, tracee)?;
    let own_rseq = tracee.get_rseq()?;
    let ip = find_syscall_insn(tracee.tid())?;
    let stub = Stub::new(Injector::new(tracee, ip)?);
    Ok(Begun { stub, own_rseq, ip })
}

/// Empty a stub of what it inherited (its rseq area, its fds but the
/// pidfd it grabs through, its memory but the `kept` ranges shared
/// copy-on-write), with scratch memory mapped and the vDSO where the
/// image has it. Nothing of the restorer's shared state is touched: any
/// thread that traces the stub may do it ([`rebuild_all`]).
fn clean(
    b: &mut Begun<'_>,
    ck: &Checkpoint,
    p: &Process,
    grab_pidfd: i32,
    kept: &[(u64, u64)],
) -> Result<(), RestoreError> {
    let stub_maps = proc::maps(b.stub.pid)?;
    kinds::threads::drop_stub_rseq(&mut b.stub, &b.own_rseq)?;
    let park = memory::map_scratch(&mut b.stub, &p.vmas, &stub_maps)?;
    let owner = kinds::fds::table_owner(ck, p);
    kinds::fds::keep_only_grab_fd(&mut b.stub, p, owner, grab_pidfd)?;
    memory::unmap_stub(&mut b.stub, &stub_maps, kept)?;
    memory::vdso::move_to_saved(&mut b.stub, &stub_maps, &p.vmas, park, b.ip)?;
    Ok(())
}

/// [`rebuild_start`] of a stub already emptied ([`clean`]): its control
/// group, its mappings.
fn rebuild_maps<'t>(
    stub: Stub<'t>,
    r: &mut Restorer<'_>,
    p: &Process,
    pages: &Pages<'_>,
    pieces: &[Piece],
    defer_fill: bool,
) -> Result<Started<'t>, RestoreError> {
    let mut cx = Rebuild::new(stub, r, pages, pieces, p, defer_fill);
    // Before the memory, which is then charged to the process's group.
    kinds::cgroups::Cgroups::restore(&mut cx, p)?;
    let t = Instant::now();
    kinds::memory::Memory::restore(&mut cx, p)?;
    cx.r.stash.get::<RebuildTimes>().memory += t.elapsed();
    Ok(Started {
        stub: cx.stub,
        fill: cx.fill,
    })
}

/// The rest of the rebuild of a process begun by [`rebuild_start`] (its
/// pages written if they were deferred); returns its other threads.
pub fn rebuild_end(
    started: Started<'_>,
    r: &mut Restorer<'_>,
    p: &Process,
    pages: &Pages<'_>,
    pieces: &[Piece],
    phases: &mut Phases,
) -> Result<Vec<Tracee>, RestoreError> {
    let t = Instant::now();
    let (fds0, threads0) = (phases.fds, phases.threads);
    let (stub, threads) = rebuild_mid(started, r, p, pages, pieces, phases)?;
    let mut cx = Rebuild::new(stub, r, pages, pieces, p, false);
    rebuild_tail(&mut cx, p)?;
    rebuild_finish(cx.stub, p, phases)?;
    let own = (phases.fds - fds0) + (phases.threads - threads0);
    phases.other += t.elapsed().saturating_sub(own);
    Ok(threads)
}

/// [`rebuild_end`] up to the process's other threads, made (they are
/// traced by this thread); its stub and those threads.
fn rebuild_mid<'t>(
    started: Started<'t>,
    r: &mut Restorer<'_>,
    p: &Process,
    pages: &Pages<'_>,
    pieces: &[Piece],
    phases: &mut Phases,
) -> Result<(Stub<'t>, Vec<Tracee>), RestoreError> {
    let Started { stub, fill } = started;
    let mut cx = Rebuild::new(stub, r, pages, pieces, p, false);
    if let Some(d) = fill {
        memory::finish_deferred(&mut cx, p, d)?;
    }
    kinds::aio::restore_process(&mut cx, p)?;
    kinds::task::Task::restore(&mut cx, p)?;
    kinds::identity::set_loginuid(&mut cx.stub, p)?;
    let t_fds = Instant::now();
    kinds::fds::Fds::restore(&mut cx, p)?;
    phases.fds += t_fds.elapsed();
    cx.r.stash.get::<RebuildTimes>().fds += t_fds.elapsed();
    memory::set_mm(&mut cx, p)?;
    kinds::signals::Signals::restore(&mut cx, p)?;
    let t_threads = Instant::now();
    kinds::threads::Threads::restore(&mut cx, p)?;
    phases.threads += t_threads.elapsed();
    kinds::eventfds::open_thread_pidfds(&mut cx, p)?;
    Ok((cx.stub, cx.threads))
}

/// The last steps of a process's main thread before its registers: they
/// read the image and the ids only (no shared state of the restorer), so
/// any thread tracing the stub may run them ([`rebuild_all`]).
fn rebuild_tail(cx: &mut Rebuild<'_, '_, '_>, p: &Process) -> Result<(), RestoreError> {
    kinds::signals::queue_pending(cx, p)?;
    kinds::timers::Timers::restore(cx, p)?;
    kinds::sysv::restore_process(cx, p)?;
    kinds::task::chroot(cx, p)?;
    let suspended = cx.r.ids.seccomp_suspended;
    let room = (cx.stub.scratch, crate::stub::SCRATCH);
    let main = &p.threads[0];
    kinds::seccomp::restore_thread(
        &mut cx.stub.inj,
        p,
        main,
        room,
        When::BeforeCreds,
        suspended,
    )?;
    kinds::identity::Identity::restore(cx, p)?;
    kinds::threads::set_pdeathsig(&mut cx.stub.inj, &p.threads[0], cx.is_root)?;
    let stub = &mut cx.stub;
    let scratch = stub.scratch;
    // With the batches' code page, its range (the parking room between
    // is empty: nothing of the image is there, see `memory::map_scratch`).
    let len = match stub.code.take() {
        Some(code) => code + cr_sys::PAGE_SIZE - scratch,
        None => crate::stub::SCRATCH,
    };
    stub.call("munmap", libc::SYS_munmap, [scratch, len, 0, 0, 0, 0])
        .step(|| "cannot unmap the restorer's scratch memory".into())?;
    memory::vdso::unmap_parked(stub, &p.vmas)?;
    kinds::seccomp::restore_main(&mut stub.inj, p, suspended)?;
    Ok(())
}

/// The main thread's own mask and registers: the stub is done.
fn rebuild_finish(stub: Stub<'_>, p: &Process, phases: &mut Phases) -> Result<(), RestoreError> {
    let t_regs = Instant::now();
    stub.inj.finish_with_mask_then(p.threads[0].sigmask, |t| {
        kinds::threads::set_registers(t, &p.threads[0])
    })??;
    phases.threads += t_regs.elapsed();
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
