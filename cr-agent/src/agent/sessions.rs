//! Sessions of the coordinated protocol on this node.
//!
//! Every session owns one OS thread that carries out the steps the
//! coordinator asks for, received over a channel. ptrace ties a stopped
//! thread to the thread that seized it, so each member's tree is frozen
//! (or rebuilt), dumped and let go by a tracer thread of its own
//! (`cr_engine::tracer`), which the session thread drives: the members of
//! a session are frozen, dumped, rebuilt and let go all at once. A session that hears nothing for its timeout ends on its own:
//! a checkpoint that was not committed is aborted (the processes run on,
//! its images are removed), a committed one lets its processes run on, a
//! restore that was not released kills what it built.
//!
//! Bounds. A checkpoint session's members stay frozen at most its freeze
//! bound (PrepareRequest.freeze_timeout_ms, from the start of PREPARE):
//! past it the session aborts on its own (or, once committed, lets its
//! processes run on: a --kill is never carried out by the agent alone).
//! Its network locks are leased ([`super::leases`]): renewed while the
//! session holds them, they lift by themselves within the lease if the
//! agent dies. Every wait on a traced thread has a deadline
//! (`cr_sys::ptrace::STOP_TIMEOUT`). The processes a session traces are
//! lent to it by the reaper (one owner of each traced process).
//!
//! A member that exits during a checkpoint is dropped from it (reported
//! as `gone`), not a reason to abort.
//!
//! While a checkpoint session holds the network lock or has written images,
//! `state_dir/sessions/ID.json` names them; an agent that was killed finds
//! them at its next start ([`sweep`]) and removes the lock and the
//! uncommitted images, so its processes' connections flow again.

use super::{fault, members, Shared};
use cr_engine::capture::{self, Held, Laps};
use cr_engine::coop::Coop;
use cr_engine::kinds::memory::dump::Arena;
use cr_engine::options::{Action, CheckpointOptions, RestoreOptions};
use cr_engine::tracer::{Go, Rendezvous, Starting, Tracer};
use cr_rpc::pb;
use serde_json::json;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

type Reply<T> = oneshot::Sender<Result<T, String>>;

/// A step of a session after its first.
enum Cmd {
    /// After a PREPARE that only ran the callbacks (`callbacks_first`).
    Freeze(Reply<pb::PrepareReply>),
    Dump(Reply<pb::DumpReply>),
    /// ABORT: `true` when the coordinator decided it (the images go),
    /// `false` when the agent ends it alone (at a stop, or having lost the
    /// coordinator: images already written stay until the coordinator
    /// decides, see [`forget_in_doubt`]).
    Abort(bool, Reply<()>),
    /// FINISH: what to do, and the members whose exit is not waited for.
    Finish(pb::After, Vec<i32>, Reply<pb::FinishReply>),
    Release(Reply<pb::ReleaseReply>),
}

impl Cmd {
    fn name(&self) -> &'static str {
        match self {
            Cmd::Freeze(_) => "FREEZE",
            Cmd::Dump(_) => "DUMP",
            Cmd::Abort(..) => "ABORT",
            Cmd::Finish(..) => "FINISH",
            Cmd::Release(_) => "RELEASE",
        }
    }
}

/// Sessions remembered after they ended (for a late FINISH or ABORT).
const ENDED_KEPT: usize = 256;

/// The sessions in progress, by id, and how the last ones ended.
#[derive(Default)]
pub struct Sessions {
    map: Mutex<HashMap<String, mpsc::Sender<Cmd>>>,
    ended: Mutex<std::collections::VecDeque<(String, String)>>,
    /// Threads waiting for members killed by a FINISH that did not wait
    /// for their exit ([`finish_killed_later`]).
    exiting: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl Sessions {
    /// Remember how session `id` ended ("its processes run on", ...).
    fn ended(&self, id: &str, how: String) {
        let mut e = self.ended.lock().unwrap_or_else(|p| p.into_inner());
        e.push_back((id.to_string(), how));
        while e.len() > ENDED_KEPT {
            e.pop_front();
        }
    }

    fn how_ended(&self, id: &str) -> Option<String> {
        let e = self.ended.lock().unwrap_or_else(|p| p.into_inner());
        e.iter()
            .rev()
            .find(|(i, _)| i == id)
            .map(|(_, h)| h.clone())
    }

    /// Sessions in progress (for leak checks).
    pub fn count(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, mpsc::Sender<Cmd>>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn insert(&self, id: &str, tx: mpsc::Sender<Cmd>) -> Result<(), String> {
        let mut m = self.lock();
        if m.contains_key(id) {
            return Err(format!("session {id} exists already on this node"));
        }
        m.insert(id.to_string(), tx);
        Ok(())
    }

    fn remove(&self, id: &str) {
        self.lock().remove(id);
    }

    /// Ids of the sessions in progress.
    pub fn ids(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    async fn send<T>(&self, id: &str, make: impl FnOnce(Reply<T>) -> Cmd) -> Result<T, String> {
        let (tx, rx) = oneshot::channel();
        let cmd = make(tx);
        let name = cmd.name();
        let sender = self
            .lock()
            .get(id)
            .cloned()
            .ok_or_else(|| match self.how_ended(id) {
                Some(how) => format!("session {id} is over on this node: {how}"),
                None => format!("no session {id} on this node (it ended or timed out)"),
            })?;
        sender
            .send(cmd)
            .map_err(|_| format!("session {id} ended before {name}"))?;
        rx.await
            .map_err(|_| format!("session {id} ended during {name}"))?
    }

    pub async fn freeze(&self, id: &str) -> Result<pb::PrepareReply, String> {
        self.send(id, Cmd::Freeze).await
    }
    pub async fn dump(&self, id: &str) -> Result<pb::DumpReply, String> {
        self.send(id, Cmd::Dump).await
    }
    /// The coordinator's ABORT; a session that no longer exists is already
    /// undone.
    pub async fn abort(&self, id: &str) -> Result<(), String> {
        if !self.lock().contains_key(id) {
            return Ok(());
        }
        self.send(id, |r| Cmd::Abort(true, r)).await
    }

    /// End a session without the coordinator (stop, lost coordinator): the
    /// processes run on; images already written stay, in doubt.
    pub async fn let_go(&self, id: &str) -> Result<(), String> {
        if !self.lock().contains_key(id) {
            return Ok(());
        }
        self.send(id, |r| Cmd::Abort(false, r)).await
    }
    pub async fn finish(
        &self,
        id: &str,
        after: pb::After,
        exit_later: Vec<i32>,
    ) -> Result<pb::FinishReply, String> {
        self.send(id, |r| Cmd::Finish(after, exit_later, r)).await
    }

    /// Wait until the members killed by a FINISH that did not wait for
    /// their exit are gone (their PIDs, ports and memory free again).
    pub fn wait_exits(&self) {
        let waiting: Vec<_> = std::mem::take(&mut *self.exiting());
        if waiting.is_empty() {
            return;
        }
        let t0 = Instant::now();
        for t in waiting {
            let _ = t.join();
        }
        info!(
            ms = t0.elapsed().as_millis() as u64,
            "waited for killed members to be gone"
        );
    }

    fn exiting(&self) -> std::sync::MutexGuard<'_, Vec<std::thread::JoinHandle<()>>> {
        self.exiting.lock().unwrap_or_else(|p| p.into_inner())
    }
    pub async fn release(&self, id: &str) -> Result<pb::ReleaseReply, String> {
        self.send(id, Cmd::Release).await
    }
}

use cr_rpc::opts::action;

fn one_line(e: &dyn std::error::Error) -> String {
    cr_sys::error::one_line(e)
}

/// The record of a checkpoint session's leftovers, for [`sweep`].
struct Record {
    path: PathBuf,
}

impl Record {
    fn new(state_dir: &Path, id: &str) -> Record {
        let dir = state_dir.join("sessions");
        let _ = std::fs::create_dir_all(&dir);
        Record {
            path: dir.join(format!("{}.json", id.replace('/', "_"))),
        }
    }

    fn write(&self, locks: &[String], dirs: &[PathBuf]) {
        self.write_as(locks, dirs, false)
    }

    /// After a DUMP that succeeded, before COMMIT: the images may be part
    /// of a checkpoint the coordinator commits (it may have, if it cannot
    /// tell us): kept until an ABORT says otherwise ([`forget_in_doubt`]).
    fn write_in_doubt(&self, locks: &[String], dirs: &[PathBuf]) {
        self.write_as(locks, dirs, true)
    }

    fn write_as(&self, locks: &[String], dirs: &[PathBuf], in_doubt: bool) {
        let mut all: Vec<String> = locks.to_vec();
        all.extend(locks.iter().map(|l| format!("{l}_syn")));
        let v = json!({"locks": all, "dirs": dirs, "in_doubt": in_doubt});
        if let Err(e) = std::fs::write(&self.path, v.to_string()) {
            warn!(path = %self.path.display(), error = %e, "cannot record the session");
        }
    }

    fn clear(&self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// At start (and at a stop that could not end every session): undo what
/// sessions of an agent that died left behind: their network locks and
/// uncommitted images, and any leased lock left in our namespace.
pub fn sweep(state_dir: &Path) {
    match cr_sys::netlock::remove_leased("cr_lock_") {
        Ok(gone) if !gone.is_empty() => {
            info!(locks = ?gone, "removed the leased network locks a dead agent left")
        }
        Ok(_) => {}
        Err(e) => warn!(error = %one_line(&e), "cannot list the network locks left behind"),
    }
    let Ok(rd) = std::fs::read_dir(state_dir.join("sessions")) else {
        return;
    };
    for e in rd.flatten() {
        let path = e.path();
        let v: serde_json::Value = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        for l in v["locks"].as_array().into_iter().flatten() {
            if let Some(name) = l.as_str().filter(|s| !s.is_empty()) {
                match cr_sys::netlock::unlock(None, name) {
                    Ok(true) => info!(
                        lock = name,
                        "removed the network lock of a session the agent lost"
                    ),
                    Ok(false) => {}
                    Err(err) => {
                        warn!(lock = name, error = %one_line(&err), "cannot remove a lost session's network lock")
                    }
                }
            }
        }
        if v["in_doubt"].as_bool() == Some(true) {
            // Dumped, not known to be committed or aborted: the images stay
            // until the coordinator's ABORT (see forget_in_doubt).
            let kept = json!({"locks": [], "dirs": v["dirs"], "in_doubt": true});
            let _ = std::fs::write(&path, kept.to_string());
            info!(record = %path.display(), "kept the images of a lost session until the coordinator decides");
            continue;
        }
        for d in v["dirs"].as_array().into_iter().flatten() {
            if let Some(d) = d.as_str() {
                if std::fs::remove_dir_all(d).is_ok() {
                    info!(dir = d, "removed the images of a session the agent lost");
                }
            }
        }
        let _ = std::fs::remove_file(&path);
    }
}

/// The coordinator's word on a session that ended here without it: ABORT
/// (`aborted`: its images in doubt go) or FINISH (committed: they stay, the
/// record goes).
pub fn forget_in_doubt(state_dir: &Path, id: &str, aborted: bool) {
    let record = Record::new(state_dir, id);
    let Some(v) = std::fs::read(&record.path)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
    else {
        return;
    };
    if v["in_doubt"].as_bool() != Some(true) {
        return;
    }
    if aborted {
        for d in v["dirs"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|d| d.as_str())
        {
            if std::fs::remove_dir_all(d).is_ok() {
                info!(
                    session = id,
                    dir = d,
                    "removed the images of an aborted session"
                );
            }
        }
    }
    record.clear();
}

/// Start session `id` on a thread of its own running `body` (which gets
/// the session's commands and sends its first reply); that first reply.
async fn start<T: Send + 'static>(
    shared: Arc<Shared>,
    id: String,
    step: &'static str,
    body: impl FnOnce(&Shared, mpsc::Receiver<Cmd>, Reply<T>) -> String + Send + 'static,
) -> Result<T, String> {
    let (tx, rx) = mpsc::channel();
    shared.sessions.insert(&id, tx)?;
    let (ready_tx, ready_rx) = oneshot::channel();
    let sh = shared.clone();
    let name = id.clone();
    let spawned = std::thread::Builder::new()
        .name(format!("session-{id}"))
        .spawn(move || {
            let how = body(&sh, rx, ready_tx);
            sh.sessions.remove(&name);
            sh.sessions.ended(&name, how);
        });
    if let Err(e) = spawned {
        shared.sessions.remove(&id);
        return Err(format!("cannot start a session thread: {e}"));
    }
    ready_rx
        .await
        .map_err(|_| format!("the session ended during {step}"))?
}

/// PREPARE: freeze the targets on a session thread; the reply once they are.
pub async fn prepare(
    shared: Arc<Shared>,
    req: pb::PrepareRequest,
) -> Result<pb::PrepareReply, String> {
    let id = req.session.clone();
    start(shared, id, "PREPARE", move |sh, rx, ready| {
        checkpoint_session(sh, req, rx, ready)
    })
    .await
}

/// Time the renewal of a session's lease goes on past its freeze bound, so
/// that the session's own orderly end comes first.
const LEASE_MARGIN: Duration = Duration::from_secs(1);

/// How many trees of a session are dumped (or rebuilt) at once: eight per
/// CPU. Their page copies are bounded anyway by the page workers (one per
/// CPU, `cr_engine::kinds::memory::pool`); the rest of a small tree's dump
/// mostly waits, for its threads' stops (every injected system call) and
/// for the fsyncs of its image, which the file system's journal commits
/// together. Measured with `cr-bench cluster` (docs/PERFORMANCE.md).
fn parallel_trees() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .saturating_mul(8)
        .clamp(4, 64)
}

/// One member of a checkpoint session: its tree, frozen by a tracer thread
/// of its own (see `cr_engine::tracer`), so that every member is frozen,
/// dumped and let go at once.
struct Member {
    pid: i32,
    dir: PathBuf,
    tracer: Tracer<Held>,
}

/// How a checkpoint session's frozen members end: the locks first (one
/// transaction per namespace), then the processes.
#[derive(Default)]
struct Frozen {
    held: Vec<Member>,
    leases: Vec<super::leases::Lease>,
    /// Members already let go, their network locks kept until FINISH (a
    /// non-blocking session's, see [`dump_in_turn`]).
    thawed: Vec<Thawed>,
}

/// A member of a non-blocking session once dumped and let go.
struct Thawed {
    pid: i32,
    dir: PathBuf,
    /// Its network lock's tables, still in force.
    tables: Vec<String>,
    /// When it was frozen (its lock taken), and for how long.
    since: Instant,
    frozen_ms: u64,
}

impl Frozen {
    fn of(held: Vec<Member>) -> Frozen {
        Frozen {
            held,
            ..Default::default()
        }
    }

    fn leases_held(&self) -> bool {
        self.leases.iter().all(|l| l.held())
    }

    /// Undo everything: locks removed, images removed (their directories
    /// too, and the checkpoint's once empty), processes run on (every
    /// member at once).
    fn abort(mut self) {
        self.leases.clear();
        release_locks(&self.held, Action::Continue);
        unlock_thawed(&self.thawed);
        let mut dirs: Vec<PathBuf> = self.held.iter().map(|m| m.dir.clone()).collect();
        dirs.extend(self.thawed.iter().map(|t| t.dir.clone()));
        cr_engine::tracer::end_all(self.held.into_iter().map(|m| m.tracer));
        for d in dirs {
            let _ = std::fs::remove_dir_all(&d);
            if let Some(p) = d.parent() {
                let _ = std::fs::remove_dir(p);
            }
        }
    }

    /// Let the dumped members run on with their network locks (and the
    /// leases renewing them) kept: moved to `into`.
    fn let_go_locked(self, into: &mut Frozen, since: Instant) -> Vec<(i32, Result<u64, String>)> {
        let Frozen { held, leases, .. } = self;
        into.leases.extend(leases);
        let pending: Vec<_> = held
            .into_iter()
            .map(|m| {
                let (pid, dir) = (m.pid, m.dir.clone());
                let p = m.tracer.end(move |mut h| {
                    let tables = h.take_lock_tables(Action::Continue);
                    let frozen = h.frozen_for().as_millis() as u64;
                    (
                        tables,
                        frozen,
                        h.finish(Action::Continue).map_err(|e| one_line(&e)),
                    )
                });
                (pid, dir, p)
            })
            .collect();
        let mut out = Vec::new();
        for (pid, dir, p) in pending {
            match p.wait() {
                Ok((tables, frozen_ms, res)) => {
                    into.thawed.push(Thawed {
                        pid,
                        dir,
                        tables,
                        since,
                        frozen_ms,
                    });
                    out.push((pid, res.map(|()| frozen_ms)));
                }
                Err(e) => out.push((pid, Err(e.to_string()))),
            }
        }
        out
    }
}

/// Remove the network locks of members already let go (one nft
/// transaction per namespace). A member that exited meanwhile took its
/// namespace's pid with it: its lock lifts with its lease.
fn unlock_thawed(thawed: &[Thawed]) {
    let tables = by_netns(
        thawed
            .iter()
            .filter(|t| !t.tables.is_empty())
            .map(|t| (t.pid, t.tables.clone())),
    );
    for (pid, tables) in tables {
        if let Err(e) = cr_sys::netlock::unlock_many(Some(pid), &tables) {
            warn!(error = %one_line(&e), "cannot remove the session's network locks");
        }
    }
}

/// The network locks of a blocking checkpoint's members, installed
/// before the freeze (one nft transaction per namespace, leased like the
/// others): the members run with their connections held for the few ms
/// until they are frozen, as they run with them held after their thaw
/// until FINISH. Once frozen, each member's lock is planned again
/// (`Held::plan_lock`); if a connection came meanwhile, these locks are
/// removed and made again. Removed on drop unless handed over
/// ([`EarlyLock::into_leases`]).
struct EarlyLock {
    /// What each target's lock holds (absent: nothing).
    sets: HashMap<i32, cr_sys::netlock::LockSet>,
    leases: Vec<super::leases::Lease>,
    /// The tables made, by a pid of their namespace.
    tables: Vec<(i32, Vec<String>)>,
}

impl EarlyLock {
    /// The locks of the targets `pids` as they are now (None: none to
    /// make, or nft failed: the locks are then made after the freeze, as
    /// before).
    fn install(shared: &Shared, session: &str, pids: &[i32], until: Instant) -> Option<EarlyLock> {
        let sets: HashMap<i32, cr_sys::netlock::LockSet> = pids
            .iter()
            .map(|&pid| (pid, capture::lock_set(pid)))
            .filter(|(_, set)| !(set.conns.is_empty() && set.listeners.is_empty()))
            .collect();
        if sets.is_empty() {
            return None;
        }
        let mut early = EarlyLock {
            sets,
            leases: Vec::new(),
            tables: Vec::new(),
        };
        let groups = by_netns(
            early
                .sets
                .iter()
                .map(|(&pid, set)| (pid, vec![(lock_name(session, pid), set.clone())])),
        );
        for (pid, locks) in groups {
            let tables = locks
                .iter()
                .flat_map(|(name, _)| [name.clone(), format!("{name}_syn")])
                .collect();
            match shared.leases.install(pid, locks, until) {
                Ok(l) => {
                    early.leases.push(l);
                    early.tables.push((pid, tables));
                }
                Err(e) => {
                    info!(session, error = %one_line(&e), "cannot lock the network before the freeze: locked once frozen");
                    return None;
                }
            }
        }
        Some(early)
    }

    /// Whether these locks are those the frozen members `held` need
    /// (`prepared`: their locks planned again), every one of them alive.
    fn covers(&self, held: &[Member], prepared: &[Prepared]) -> bool {
        let empty = cr_sys::netlock::LockSet::default();
        held.len() == prepared.len()
            && self
                .sets
                .keys()
                .all(|pid| held.iter().any(|m| m.pid == *pid))
            && held.iter().zip(prepared).all(|(m, p)| {
                let before = self.sets.get(&m.pid).unwrap_or(&empty);
                before.covers(p.lock.as_ref().unwrap_or(&empty))
            })
    }

    /// The leases, handed over with the tables they renew (removed with
    /// the members' own locks from now on).
    fn into_leases(mut self) -> Vec<super::leases::Lease> {
        self.tables.clear();
        std::mem::take(&mut self.leases)
    }
}

impl Drop for EarlyLock {
    fn drop(&mut self) {
        self.leases.clear();
        for (pid, tables) in &self.tables {
            if let Err(e) = cr_sys::netlock::unlock_many(Some(*pid), tables) {
                warn!(error = %one_line(&e), "cannot remove the network locks made before the freeze");
            }
        }
    }
}

/// What PREPARE learns of a frozen member before its lock is taken.
struct Prepared {
    lock: Option<cr_sys::netlock::LockSet>,
    processes: usize,
    threads: usize,
}

/// A member to checkpoint: its PID, image directory, options, its
/// processes' libcr callbacks once they ran (`callbacks_first`), and the
/// room its memory is copied into while frozen ([`reserve_arenas`]).
type Target = (i32, PathBuf, CheckpointOptions, Option<Coop>, Option<Arena>);

/// Before anything of a session is checked, locked or written: room for
/// the memory of members that continue ([`reserve_arenas`]), and the
/// session's record (the checks make the image directories).
fn reserve_and_record(
    after: pb::After,
    targets: &mut [Target],
    record: &Record,
    (locks, dirs): (&[String], &[PathBuf]),
    laps: &mut Laps,
) {
    if after == pb::After::Continue {
        reserve_arenas(targets);
    }
    laps.lap("arenas");
    record.write(locks, dirs);
    laps.lap("record");
}

/// For a checkpoint that continues: room for every target's memory, out
/// of one budget for the node (`capture::arena_budget`), reserved before
/// anything is frozen. With it a member runs on as soon as its state is
/// read, while its image is written ([`dump_all`]); without (no memory
/// to spare), it stays frozen until its image is written. An incremental
/// target reserves nothing ahead: its room is mapped as its copy needs
/// it, within an equal share of what the others left.
fn reserve_arenas(targets: &mut [Target]) {
    let mut left = capture::arena_budget();
    for t in targets.iter_mut().filter(|t| t.2.parent.is_none()) {
        t.4 = capture::snapshot_arena(t.0, false, left);
        left = left.saturating_sub(t.4.as_ref().map_or(0, |a| a.held() as u64));
    }
    let incremental = targets.iter().filter(|t| t.2.parent.is_some()).count() as u64;
    for t in targets.iter_mut().filter(|t| t.2.parent.is_some()) {
        t.4 = capture::snapshot_arena(t.0, true, left / incremental);
    }
}

/// Run every target's libcr callbacks at once, nothing frozen
/// (`callbacks_first`): how many processes took part. On a refusal or a
/// timeout the first one (in `targets` order); the others' callbacks
/// learn that the checkpoint failed when `targets` is dropped. A member
/// that exited meanwhile is left to the freeze (which drops it).
fn callbacks_all(targets: &mut [Target]) -> Result<usize, String> {
    let results: Vec<_> = std::thread::scope(|s| {
        let running: Vec<_> = targets
            .iter()
            .map(|(pid, _, opts, ..)| {
                let (pid, opts) = (*pid, opts.clone());
                std::thread::Builder::new()
                    .name(format!("callbacks-{pid}"))
                    .spawn_scoped(s, move || {
                        capture::callbacks(pid, &opts).map_err(|e| one_line(&e))
                    })
            })
            .collect();
        running
            .into_iter()
            .map(|r| match r {
                Ok(h) => h
                    .join()
                    .unwrap_or_else(|_| Err("its callbacks' thread panicked".into())),
                Err(e) => Err(format!("cannot start a thread for its callbacks: {e}")),
            })
            .collect()
    });
    let mut cooperating = 0;
    let mut failed = None;
    for (t, r) in targets.iter_mut().zip(results) {
        match r {
            Ok(c) => {
                cooperating += c.len();
                t.3 = Some(c);
            }
            Err(_) if members::start_time(t.0).is_none() => {}
            Err(e) => {
                failed.get_or_insert(format!("process {}: {e}", t.0));
            }
        }
    }
    match failed {
        Some(msg) => Err(msg),
        None => Ok(cooperating),
    }
}

/// Freeze every target at once, each on its tracer thread: the frozen
/// members in the order of `targets` and the PIDs of those that exited
/// before they were frozen; on any other failure the first (in that
/// order), every member frozen meanwhile let go. Each member's checks
/// (`capture::freeze`) run before any member is stopped (a
/// [`Rendezvous`]), so that none waits frozen for the others' checks.
fn freeze_all(targets: Vec<Target>, session: &str) -> Result<(Vec<Member>, Vec<i32>), String> {
    let checking = check_all(targets, None);
    checking.go.give(true);
    checking.join(session)
}

/// The targets of a node being checked before their freeze, each on its
/// tracer thread ([`check_all`]); frozen once [`Checking::go`] is given.
struct Checking {
    go: Arc<Go>,
    starting: Vec<(i32, PathBuf, Starting<Held, String>)>,
    /// A tracer thread that could not be started.
    failed: Option<String>,
}

/// Start the checks of every target at once, each on its tracer thread
/// (`capture::freeze`); each member, once checked and every member of
/// the node checked too (a [`Rendezvous`]), waits for the signal
/// ([`Checking::go`]) before it is frozen: true, all are frozen at once;
/// false, none is. With `ready`, the giver waits there first until every
/// member is checked ([`Go::wait_ready`]): the coordinator's FREEZE then
/// freezes every node's members at once instead of each node's as soon as
/// its checks are done (which took from 0.1 to 0.8 s under load: the
/// first node frozen waited for the last one's checks).
fn check_all(targets: Vec<Target>, ready: Option<&mut Duration>) -> Checking {
    let t = Instant::now();
    let n = targets.len();
    let (go, tickets) = Go::new(n);
    let mut starting = Vec::with_capacity(n);
    let mut failed = None;
    let arrivals = Rendezvous::arrivals(n);
    for (((pid, dir, opts, coop, arena), arrival), ticket) in
        targets.into_iter().zip(arrivals).zip(tickets)
    {
        let make = move || {
            let mut held = capture::freeze(pid, &opts, false, coop, move || {
                arrival.wait();
                ticket.wait()
            })
            .map_err(|e| one_line(&e))?;
            held.arena = arena;
            Ok::<_, String>(held)
        };
        match Tracer::start(format!("freeze-{pid}"), make) {
            Ok(s) => starting.push((pid, dir, s)),
            Err(e) => {
                failed = Some(format!("cannot start a thread to freeze {pid}: {e}"));
                break;
            }
        }
    }
    let checking = Checking {
        go,
        starting,
        failed,
    };
    if let Some(waited) = ready {
        if checking.failed.is_none() {
            // Each check is bounded (its waits on the tree have
            // deadlines); this one too, in case.
            checking
                .go
                .wait_ready(checking.starting.len(), CHECKS_BOUND);
        }
        *waited = t.elapsed();
    }
    checking
}

/// A session that ends without a word (it panicked, say) does not leave
/// its members' tracer threads waiting: nothing is frozen.
impl Drop for Checking {
    fn drop(&mut self) {
        self.go.give(false);
    }
}

/// Longest the node waits for its members' checks before FREEZE.
const CHECKS_BOUND: Duration = Duration::from_secs(60);

impl Checking {
    /// Give up: nothing is frozen, the checks' image directories go.
    fn abandon(self, session: &str) {
        self.go.give(false);
        if let Ok((held, _)) = self.join(session) {
            Frozen::of(held).abort();
        }
    }

    /// Wait for every member's freeze (see [`freeze_all`]).
    fn join(mut self, session: &str) -> Result<(Vec<Member>, Vec<i32>), String> {
        let mut failed = self.failed.take();
        if failed.is_some() {
            self.go.give(false);
        }
        let mut held = Vec::new();
        let mut gone = Vec::new();
        for (pid, dir, s) in std::mem::take(&mut self.starting) {
            let err = match s.join() {
                Ok(tracer) => {
                    held.push(Member { pid, dir, tracer });
                    continue;
                }
                Err(Ok(e)) => e,
                Err(Err(g)) => g.to_string(),
            };
            let _ = std::fs::remove_dir_all(&dir);
            if members::start_time(pid).is_none() {
                info!(
                    session,
                    pid,
                    error = err,
                    "member exited before it was frozen: dropped from the checkpoint"
                );
                gone.push(pid);
            } else {
                failed.get_or_insert(format!("process {pid}: {err}"));
            }
        }
        match failed {
            Some(msg) => {
                Frozen::of(held).abort();
                Err(msg)
            }
            None => Ok((held, gone)),
        }
    }
}

/// On every member at once: its network lock planned (`lock_name`).
fn plan_all(held: &[Member], session: &str) -> Result<Vec<Prepared>, String> {
    let pending: Vec<_> = held
        .iter()
        .map(|m| {
            let name = lock_name(session, m.pid);
            m.tracer.run(move |h| Prepared {
                lock: h.plan_lock(&name),
                processes: h.pids().len(),
                threads: h.threads(),
            })
        })
        .collect();
    pending
        .into_iter()
        .map(|p| p.wait().map_err(|e| e.to_string()))
        .collect()
}

/// On every member at once, once the locks hold (before, the kernel still
/// takes and acknowledges data for the frozen processes): the bookmarks of
/// its connections.
fn bookmarks_all(held: &[Member]) -> Result<Vec<pb::Bookmark>, String> {
    let pending: Vec<_> = held
        .iter()
        .map(|m| {
            let pid = m.pid;
            m.tracer.run(move |h| {
                h.bookmarks()
                    .into_iter()
                    .map(|b| to_pb(b, pid))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut out = Vec::new();
    for p in pending {
        out.extend(p.wait().map_err(|e| e.to_string())?);
    }
    Ok(out)
}

fn checkpoint_session(
    shared: &Shared,
    req: pb::PrepareRequest,
    rx: mpsc::Receiver<Cmd>,
    ready: Reply<pb::PrepareReply>,
) -> String {
    let mut t0 = Instant::now();
    let idle = Duration::from_millis(u64::from(req.timeout_ms.max(1000)));
    let bound = match req.freeze_timeout_ms {
        0 => idle,
        ms => Duration::from_millis(u64::from(ms)),
    };
    let mut deadline = t0 + bound;
    let after = pb::After::try_from(req.after).unwrap_or(pb::After::Continue);
    let record = Record::new(&shared.config.state_dir, &req.session);
    // The reaper lets the targets alone while this session traces them.
    let pids: Vec<i32> = req.targets.iter().map(|t| t.pid).collect();
    let loan = shared.reaper.lend(&pids);
    let mut locks = Vec::new();
    let mut dirs = Vec::new();
    let fail = |held: Vec<Member>, msg: String, ready: Reply<pb::PrepareReply>| {
        Frozen::of(held).abort();
        record.clear();
        let _ = ready.send(Err(msg.clone()));
        format!("PREPARE failed ({msg}): its processes run on")
    };
    let mut targets = Vec::with_capacity(req.targets.len());
    for t in &req.targets {
        let dir = shared
            .config
            .images
            .join(&req.subdir)
            .join(format!("{}-{}", shared.config.node, t.pid));
        let mut opts = CheckpointOptions {
            dir: Some(dir.clone()),
            workers: Some(shared.workers),
            parent: (!t.parent.is_empty()).then(|| PathBuf::from(&t.parent)),
            track_mem: !t.parent.is_empty(),
            lock_name: Some(lock_name(&req.session, t.pid)),
            save_files: (req.save_files > 0).then_some(req.save_files),
            // What the member asked to keep in its images (cr_run
            // --checkpoint-save-file: a batch script).
            save_file: shared
                .members
                .get(t.pid)
                .map(|m| m.save_file.iter().map(PathBuf::from).collect())
                .unwrap_or_default(),
            ..Default::default()
        };
        opts.set_action(action(after));
        cr_rpc::opts::set_cooperation(&mut opts, req.coop.as_ref());
        if let Some(p) = dir.parent() {
            if let Err(e) = std::fs::create_dir_all(p) {
                return fail(
                    Vec::new(),
                    format!("cannot create {}: {e}", p.display()),
                    ready,
                );
            }
        }
        dirs.push(dir.clone());
        locks.push(lock_name(&req.session, t.pid));
        targets.push((t.pid, dir, opts, None, None));
    }
    if req.non_blocking && after != pb::After::Continue {
        let msg = format!(
            "a non-blocking checkpoint lets each member run on after its dump: {} is not possible",
            after.as_str_name()
        );
        return fail(Vec::new(), msg, ready);
    }
    let mut ready = ready;
    // Blocking, after the callbacks (`callbacks_first`): every member
    // checked before the reply, frozen on FREEZE.
    let mut checking = None;
    let mut checks_laps = None;
    if req.callbacks_first {
        // Every member's callbacks, then the coordinator's FREEZE once
        // those of every node are done (they may still need each other).
        let t = Instant::now();
        let cooperating = match callbacks_all(&mut targets) {
            Ok(n) => n,
            Err(msg) => return fail(Vec::new(), msg, ready),
        };
        let callbacks_ms = t.elapsed().as_millis() as u64;
        // Blocking: the members' checks too (they run after the
        // callbacks, as before), so that FREEZE freezes every node's
        // members at once.
        let mut checks = Duration::ZERO;
        if !req.non_blocking {
            let mut laps = Laps::new();
            reserve_and_record(after, &mut targets, &record, (&locks, &dirs), &mut laps);
            let pids: Vec<i32> = targets.iter().map(|t| t.0).collect();
            checking = Some((
                check_all(std::mem::take(&mut targets), Some(&mut checks)),
                pids,
            ));
            laps.lap("checks");
            checks_laps = Some(laps);
        }
        let abandon = |checking: Option<(Checking, Vec<i32>)>| {
            if let Some((c, _)) = checking {
                c.abandon(&req.session);
                record.clear();
            }
        };
        info!(
            session = req.session,
            cooperating,
            callbacks_ms,
            checks_ms = checks.as_millis() as u64,
            "callbacks ready (and the members checked)"
        );
        let r = pb::PrepareReply {
            cooperating: cooperating as u32,
            callbacks_ms,
            ..Default::default()
        };
        if ready.send(Ok(r)).is_err() {
            abandon(checking);
            return "the coordinator went away during PREPARE: its processes run on".into();
        }
        // Dropping `targets` on a return tells the callbacks it failed.
        match rx.recv_timeout(idle) {
            Ok(Cmd::Freeze(r)) => {
                // The freeze bound counts from here.
                ready = r;
                t0 = Instant::now();
                deadline = t0 + bound;
                if let Some(l) = checks_laps.as_mut() {
                    l.lap("until_freeze");
                }
            }
            Ok(Cmd::Abort(_, r)) => {
                abandon(checking);
                let _ = r.send(Ok(()));
                return "aborted before the freeze: its processes run on".into();
            }
            Ok(other) => {
                abandon(checking);
                let name = other.name();
                reply_err(other, format!("{name} before FREEZE"));
                return format!("{name} came before FREEZE: its processes run on");
            }
            Err(_) => {
                abandon(checking);
                return "no FREEZE from the coordinator: its processes run on".into();
            }
        }
    }
    // Where the time of PREPARE goes (the members frozen from "freeze").
    let mut laps = checks_laps.unwrap_or_default();
    let early;
    let mut in_turn = Vec::new();
    let (held, gone) = if let Some((checking, pids)) = checking {
        // Checked before FREEZE: the locks (nft takes tens of ms), then
        // every member stopped at once.
        early = EarlyLock::install(shared, &req.session, &pids, deadline + LEASE_MARGIN);
        laps.lap("early_lock");
        checking.go.give(true);
        match checking.join(&req.session) {
            Ok(f) => f,
            Err(msg) => return fail(Vec::new(), msg, ready),
        }
    } else {
        reserve_and_record(after, &mut targets, &record, (&locks, &dirs), &mut laps);
        // Blocking: the network locks go in before the freeze (nft takes
        // tens of ms), checked once the members are frozen.
        let pids: Vec<i32> = targets.iter().map(|t| t.0).collect();
        early = (!req.non_blocking)
            .then(|| EarlyLock::install(shared, &req.session, &pids, deadline + LEASE_MARGIN))
            .flatten();
        laps.lap("early_lock");
        // Non-blocking: nothing is frozen before DUMP (`dump_in_turn`).
        if req.non_blocking {
            let (alive, gone): (Vec<_>, Vec<_>) = targets
                .into_iter()
                .partition(|(pid, ..)| members::start_time(*pid).is_some());
            in_turn = alive;
            (Vec::new(), gone.into_iter().map(|(pid, ..)| pid).collect())
        } else {
            match freeze_all(targets, &req.session) {
                Ok(f) => f,
                Err(msg) => return fail(Vec::new(), msg, ready),
            }
        }
    };
    // The members' checks, then all stopped at once.
    laps.lap("freeze");
    let prepared = match plan_all(&held, &req.session) {
        Ok(p) => p,
        Err(msg) => return fail(held, msg, ready),
    };
    laps.lap("plan");
    // Every tree's connections held still in one nft transaction per
    // network namespace, leased until the freeze bound: the locks made
    // before the freeze if they hold every connection the frozen members
    // have, else made again now.
    let covered = early.as_ref().is_some_and(|e| e.covers(&held, &prepared));
    let mut frozen;
    let plans = match early {
        Some(e) if covered => {
            frozen = Frozen::of(held);
            frozen.leases = e.into_leases();
            Vec::new()
        }
        early => {
            if early.is_some() {
                info!(
                    session = req.session,
                    "the members' connections changed before the freeze: their network locks are made again"
                );
            }
            drop(early);
            let plans = by_netns(held.iter().zip(&prepared).filter_map(|(m, p)| {
                let set = p.lock.clone()?;
                Some((m.pid, vec![(lock_name(&req.session, m.pid), set)]))
            }));
            frozen = Frozen::of(held);
            plans
        }
    };
    for (pid, locks) in plans {
        match shared.leases.install(pid, locks, deadline + LEASE_MARGIN) {
            Ok(l) => frozen.leases.push(l),
            Err(e) => {
                let msg = format!("network lock: {}", one_line(&e));
                return fail(std::mem::take(&mut frozen.held), msg, ready);
            }
        }
    }
    laps.lap("lock");
    let bookmarks = match bookmarks_all(&frozen.held) {
        Ok(b) => b,
        Err(msg) => return fail(std::mem::take(&mut frozen.held), msg, ready),
    };
    laps.lap("bookmarks");
    let freeze_ms = t0.elapsed().as_millis() as u64;
    fault::point("prepare", shared);
    let mut reply = pb::PrepareReply {
        freeze_ms,
        gone: gone.clone(),
        bookmarks,
        ..Default::default()
    };
    for p in prepared {
        reply.processes += p.processes as u32;
        reply.threads += p.threads as u32;
    }
    if req.non_blocking {
        // Nothing frozen yet: the members that will be.
        reply.processes = in_turn.len() as u32;
    }
    info!(
        session = req.session,
        job = req.job,
        members = frozen.held.len(),
        gone = gone.len(),
        processes = reply.processes,
        freeze_ms,
        bound_ms = bound.as_millis() as u64,
        "prepared"
    );
    debug!(session = req.session, laps = %laps, "PREPARE's time (µs per step)");
    let prepared_at = Instant::now();
    if ready.send(Ok(reply)).is_err() {
        // The caller went away: nothing more will come.
        frozen.abort();
        record.clear();
        return "the coordinator went away during PREPARE: its processes run on".into();
    }
    let mut dumped = false;
    loop {
        let now = Instant::now();
        let wait = idle.min(deadline.saturating_duration_since(now));
        let cmd = match rx.recv_timeout(wait) {
            Ok(c) => c,
            Err(_) => {
                let why = if Instant::now() >= deadline {
                    format!("frozen for {} ms, the freeze bound", bound.as_millis())
                } else {
                    "no word from the coordinator".to_string()
                };
                warn!(
                    session = req.session,
                    dumped, "{why}: ending the session on my own (the processes run on)"
                );
                if dumped {
                    let _ = finish_all(frozen, Action::Continue);
                    record.write_in_doubt(&[], &dirs);
                } else {
                    frozen.abort();
                    record.clear();
                }
                return format!("it ended on its own ({why}): its processes run on");
            }
        };
        if Instant::now() >= deadline && matches!(cmd, Cmd::Dump(_)) {
            let name = cmd.name();
            let msg = format!(
                "{name} came after the freeze bound ({} ms): the checkpoint is aborted on this node, its processes run on",
                bound.as_millis()
            );
            warn!(session = req.session, "{msg}");
            reply_err(cmd, msg);
            frozen.abort();
            record.clear();
            return "aborted at the freeze bound: its processes run on".into();
        }
        match cmd {
            Cmd::Dump(r) => {
                debug!(
                    session = req.session,
                    waited_ms = prepared_at.elapsed().as_millis() as u64,
                    "DUMP came (waited since the PREPARE reply, the members frozen)"
                );
                fault::point("dump", shared);
                let res = if req.non_blocking {
                    let until = deadline + LEASE_MARGIN;
                    let turn = std::mem::take(&mut in_turn);
                    dump_in_turn(shared, &req.session, &mut frozen, turn, until)
                } else {
                    dump_all(shared, &req.session, &mut frozen)
                };
                let res = res.and_then(|d| {
                    if frozen.leases_held() {
                        Ok(d)
                    } else {
                        Err("the network lock's lease lapsed during the dump: the images cannot be trusted".into())
                    }
                });
                if res.is_ok() {
                    dumped = true;
                    record.write_in_doubt(&locks, &dirs);
                }
                let _ = r.send(res);
            }
            Cmd::Finish(after, exit_later, r) => {
                if !dumped {
                    let _ = r.send(Err("FINISH before DUMP".into()));
                    continue;
                }
                // Only a committed checkpoint is ever finished: FINISH is
                // the coordinator's word that it committed. The images
                // are final: a later sweep keeps them (but still removes
                // the locks: the processes of an agent that dies now run
                // on).
                record.write(&locks, &[]);
                fault::point("commit", shared);
                fault::point("finish", shared);
                let later = (after == pb::After::Kill).then_some(&exit_later[..]);
                let res = match later.filter(|l| !l.is_empty()) {
                    None => finish_all(frozen, action(after)),
                    Some(later) => finish_killed_later(shared, frozen, later, loan),
                };
                record.clear();
                let how = match &res {
                    Ok(_) => format!("finished ({})", after.as_str_name()),
                    Err(e) => format!("FINISH failed: {e}"),
                };
                let _ = r.send(res);
                return how;
            }
            Cmd::Abort(decided, r) => {
                if dumped && !decided {
                    // Ended here alone: the coordinator may commit them.
                    finish_all(frozen, Action::Continue).ok();
                    record.write_in_doubt(&[], &dirs);
                } else {
                    frozen.abort();
                    record.clear();
                }
                info!(
                    session = req.session,
                    decided, "aborted; the processes run on"
                );
                let _ = r.send(Ok(()));
                return "aborted: its processes run on".into();
            }
            other @ Cmd::Release(_) => reply_err(other, "RELEASE of a checkpoint session".into()),
            other @ Cmd::Freeze(_) => reply_err(
                other,
                "FREEZE of a session already frozen (or not asked to wait for it)".into(),
            ),
        }
    }
}

/// The network lock of a session's member: named before it exists, so an
/// agent killed at any point finds it in the session's record.
fn lock_name(session: &str, pid: i32) -> String {
    let s: String = session
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    format!("cr_lock_{s}_{pid}")
}

fn to_pb(b: cr_image::bookmarks::Bookmark, pid: i32) -> pb::Bookmark {
    pb::Bookmark {
        local: b.local,
        remote: b.remote,
        snd_una: b.snd_una,
        snd_nxt: b.snd_nxt,
        rcv_nxt: b.rcv_nxt,
        write_seq: b.write_seq,
        pid,
    }
}

/// Write every member's image, all at once (at most [`parallel_trees`]
/// working at a time; their page copies share the page workers); a member that died meanwhile
/// (killed while frozen) is dropped from the checkpoint and reported
/// `gone`. Every dump runs to its end before the reply: a failure of one
/// is reported once all are done (the coordinator then aborts them all).
///
/// Members with room for their memory ([`reserve_arenas`]) run on before
/// their images are written, once every member of the node has its state
/// read (a [`Rendezvous`]: members of one node may share memory, files
/// or pipes, which the network lock does not hold); their connections
/// stay held by the network lock until FINISH, so no byte moves between
/// them and their peers until the checkpoint ends (docs/PROTOCOLS.md).
/// An abort then removes the locks and the images: the processes already
/// run.
fn dump_all(shared: &Shared, session: &str, f: &mut Frozen) -> Result<pb::DumpReply, String> {
    let gate = Arc::new(cr_engine::tracer::Gate::new(parallel_trees()));
    let pending: Vec<_> = f
        .held
        .iter()
        .zip(Rendezvous::arrivals(f.held.len()))
        .map(|(m, arrival)| {
            let (gate, node, pid) = (gate.clone(), shared.config.node.clone(), m.pid);
            m.tracer.run(move |h| {
                let mut pass = Some(gate.enter());
                let (pass, gate) = (&mut pass, &gate);
                dump_member(h, &node, pid, move || {
                    // Others may need the gate to reach the rendezvous.
                    drop(pass.take());
                    arrival.wait();
                    // Every member of the node runs on at once (letting
                    // go takes no place); their stores take turns.
                    move || *pass = Some(gate.enter())
                })
            })
        })
        .collect();
    let results: Vec<Result<pb::ImageInfo, String>> = pending
        .into_iter()
        .map(|p| p.wait().map_err(|e| e.to_string()).and_then(|r| r))
        .collect();
    let mut reply = pb::DumpReply::default();
    let mut first_err = None;
    let mut gone = Vec::new();
    let mut kept = Vec::with_capacity(f.held.len());
    for (m, res) in std::mem::take(&mut f.held).into_iter().zip(results) {
        match res {
            Ok(info) => {
                reply.images.push(info);
                kept.push(m);
            }
            Err(e) if members::start_time(m.pid).is_none() => {
                info!(
                    session,
                    pid = m.pid,
                    error = e,
                    "member exited while frozen: dropped from the checkpoint"
                );
                gone.push(m);
            }
            Err(e) => {
                first_err.get_or_insert(format!("process {}: {e}", m.pid));
                kept.push(m);
            }
        }
    }
    f.held = kept;
    for m in gone {
        let tables = m
            .tracer
            .run(|h| h.take_lock_tables(Action::Continue))
            .wait()
            .unwrap_or_default();
        for l in &f.leases {
            l.forget(&tables);
        }
        // Its tables, in the namespace of a member still here (else they
        // lift with their lease).
        if let Some(other) = f.held.first() {
            let _ = cr_sys::netlock::unlock_many(Some(other.pid), &tables);
        }
        reply.gone.push(m.pid);
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(reply),
    }
}

/// A non-blocking session's DUMP: each member in turn is frozen, its
/// connections locked, dumped and let go at once, its lock kept (leased
/// until `until`) so that nothing moves on its connections until every
/// member of the job is dumped: whatever order the members are dumped in,
/// no byte a member received after its dump can be in a peer's image as
/// not yet sent, and no byte acknowledged to a peer can be missing from
/// its image (docs/PROTOCOLS.md). On a failure the members dumped so far
/// stay in `f` (the ABORT that follows removes their locks and images).
fn dump_in_turn(
    shared: &Shared,
    session: &str,
    f: &mut Frozen,
    targets: Vec<Target>,
    until: Instant,
) -> Result<pb::DumpReply, String> {
    let mut reply = pb::DumpReply::default();
    for target in targets {
        let pid = target.0;
        let since = Instant::now();
        let (held, gone) = freeze_all(vec![target], session)?;
        reply.gone.extend(gone);
        if held.is_empty() {
            continue;
        }
        let prepared = match plan_all(&held, session) {
            Ok(p) => p,
            Err(e) => {
                Frozen::of(held).abort();
                return Err(format!("process {pid}: {e}"));
            }
        };
        let name = lock_name(session, pid);
        let locks: Vec<_> = prepared
            .into_iter()
            .filter_map(|p| p.lock)
            .map(|set| (name.clone(), set))
            .collect();
        let mut one = Frozen::of(held);
        if !locks.is_empty() {
            match shared.leases.install(pid, locks, until) {
                Ok(l) => one.leases.push(l),
                Err(e) => {
                    one.abort();
                    return Err(format!("process {pid}: network lock: {}", one_line(&e)));
                }
            }
        }
        let mut dumped = match dump_all(shared, session, &mut one) {
            Ok(d) => d,
            Err(e) => {
                one.abort();
                return Err(e);
            }
        };
        reply.gone.append(&mut dumped.gone);
        if one.held.is_empty() {
            continue; // exited while frozen
        }
        for (p, res) in one.let_go_locked(f, since) {
            let frozen_ms = res.map_err(|e| format!("process {p}: letting it go: {e}"))?;
            for i in dumped.images.iter_mut().filter(|i| i.pid == p) {
                i.frozen_ms = frozen_ms;
            }
        }
        reply.images.append(&mut dumped.images);
    }
    Ok(reply)
}

/// Dump one member's tree (on its tracer thread) and describe its image;
/// `before_run_on`: see `Held::dump_with`.
fn dump_member<R: FnOnce()>(
    h: &mut Held,
    node: &str,
    pid: i32,
    before_run_on: impl FnOnce() -> R,
) -> Result<pb::ImageInfo, String> {
    let s = h.dump_with(before_run_on).map_err(|e| one_line(&e))?;
    let dir = h.dir().to_path_buf();
    let ck = cr_image::ImageDir::open(&dir)
        .and_then(|d| d.read_checkpoint())
        .map_err(|e| one_line(&e))?;
    let (uid, command) = members::describe(pid);
    Ok(pb::ImageInfo {
        node: node.to_string(),
        pid,
        dir: dir.display().to_string(),
        processes: s.processes as u32,
        page_bytes: s.page_bytes,
        store_bytes: s.store_bytes,
        frozen_ms: s.frozen.as_millis() as u64,
        bookmarks: cr_image::bookmarks::of(&ck)
            .into_iter()
            .map(|b| to_pb(b, pid))
            .collect(),
        command,
        uid,
        replicas: Vec::new(),
    })
}

/// `(pid, items)` merged per network namespace of the pid: one pid of each
/// namespace (where nft runs) with all its items.
fn by_netns<T>(items: impl Iterator<Item = (i32, Vec<T>)>) -> Vec<(i32, Vec<T>)> {
    let mut out: HashMap<String, (i32, Vec<T>)> = HashMap::new();
    for (pid, v) in items {
        let ns = cr_sys::proc::read_link(&format!("/proc/{pid}/ns/net")).unwrap_or_default();
        out.entry(ns).or_insert((pid, Vec::new())).1.extend(v);
    }
    out.into_values().collect()
}

/// Remove the network locks that letting the trees go with `action` would
/// remove, all in one nft transaction per network namespace (each table
/// deleted on its own costs an RCU grace period, ~25 ms).
fn release_locks(held: &[Member], action: Action) {
    let pending: Vec<_> = held
        .iter()
        .map(|m| (m.pid, m.tracer.run(move |h| h.take_lock_tables(action))))
        .collect();
    let tables = by_netns(
        pending
            .into_iter()
            .map(|(pid, p)| (pid, p.wait().unwrap_or_default()))
            .filter(|(_, t)| !t.is_empty()),
    );
    for (pid, tables) in tables {
        if let Err(e) = cr_sys::netlock::unlock_many(Some(pid), &tables) {
            warn!(error = %one_line(&e), "cannot remove the session's network locks");
        }
    }
}

/// Let every tree go, all at once (the locks first: removed for CONTINUE,
/// kept for the image, for good, after a kill or stop); how long each was
/// frozen.
fn finish_all(f: Frozen, action: Action) -> Result<pb::FinishReply, String> {
    let (reply, later) = let_all_go(f, action, &[]);
    if let Some(l) = later {
        l.wait(); // none: every member was waited for
    }
    reply
}

/// FINISH with KILL of a session some of whose members (`later`) are
/// restored on another node (a migration): every tree is killed, but the
/// reply does not wait for those members' exit (a process of 1 GiB takes
/// a quarter of a second to unmap its memory: that was inside the
/// migration's downtime). They are no longer reported as members; a
/// thread of its own waits for their exit, holding the reaper's `loan`
/// and the network locks' leases until then, and a later RESTORE on this
/// node waits for that thread ([`Sessions::wait_exits`]).
fn finish_killed_later(
    shared: &Shared,
    f: Frozen,
    later: &[i32],
    loan: super::reaper::Loan,
) -> Result<pb::FinishReply, String> {
    if !f.thawed.is_empty() {
        // A non-blocking session's members run already: nothing to defer.
        return finish_all(f, Action::Kill);
    }
    shared.members.forget(later);
    let (reply, rest) = let_all_go(f, Action::Kill, later);
    if let Some(rest) = rest {
        let spawned = std::thread::Builder::new()
            .name("killed-exits".into())
            .spawn(move || {
                let t0 = Instant::now();
                rest.wait();
                drop(loan);
                info!(
                    ms = t0.elapsed().as_millis() as u64,
                    "killed members gone (their exit was not waited for by FINISH)"
                );
            });
        match spawned {
            Ok(t) => shared.sessions.exiting().push(t),
            Err(e) => {
                warn!(error = %e, "cannot start a thread to wait for killed members: they are gone when the next restore starts")
            }
        }
    }
    reply
}

/// What [`let_all_go`] left to wait for: members being let go, and the
/// network locks' leases, made permanent once they are (after a kill or
/// stop: a member is never left running behind a lock that does not lift).
struct LetGo {
    pending: Vec<(i32, LetGoResult)>,
    leases: Vec<super::leases::Lease>,
    action: Action,
}

type LetGoResult = cr_engine::tracer::Pending<(u64, Result<(), String>)>;

impl LetGo {
    /// Wait for every member (a failure is logged: the reply went).
    fn wait(self) {
        for (pid, p) in self.pending {
            if let Err(e) = p.wait().map_or_else(|e| Err(e.to_string()), |r| r.1) {
                warn!(pid, error = e, "letting a checkpointed process go failed");
            }
        }
        if self.action != Action::Continue {
            for l in self.leases {
                l.make_permanent();
            }
        }
    }
}

/// Let every tree go as [`finish_all`] says, waiting for each but the
/// members in `later` (their frozen time is taken as they are let go);
/// what is left to wait for when `later` is not empty.
fn let_all_go(
    f: Frozen,
    action: Action,
    later: &[i32],
) -> (Result<pb::FinishReply, String>, Option<LetGo>) {
    let Frozen {
        held,
        mut leases,
        thawed,
    } = f;
    if action == Action::Continue || !thawed.is_empty() {
        leases.clear();
    }
    release_locks(&held, action);
    // A non-blocking session's: already running, only their locks go.
    unlock_thawed(&thawed);
    let mut reply = pb::FinishReply::default();
    for t in &thawed {
        reply.frozen_ms = reply.frozen_ms.max(t.frozen_ms);
        reply.member_frozen_ms.insert(t.pid, t.frozen_ms);
        reply.held_ms = reply.held_ms.max(t.since.elapsed().as_millis() as u64);
    }
    let (mut now, mut rest) = (Vec::new(), Vec::new());
    for m in held {
        let pid = m.pid;
        let (ftx, frx) = mpsc::channel();
        let p = m.tracer.end(move |h| {
            let frozen = h.frozen_for().as_millis() as u64;
            let _ = ftx.send(frozen);
            (frozen, h.finish(action).map_err(|e| one_line(&e)))
        });
        if later.contains(&pid) {
            // Sent as its tracer starts to let it go.
            let frozen = frx.recv().unwrap_or(0);
            reply.frozen_ms = reply.frozen_ms.max(frozen);
            reply.member_frozen_ms.insert(pid, frozen);
            rest.push((pid, p));
        } else {
            now.push((pid, p));
        }
    }
    let mut first_err = None;
    for (pid, p) in now {
        let (frozen, res) = match p.wait() {
            Ok(r) => r,
            Err(e) => (0, Err(e.to_string())),
        };
        reply.frozen_ms = reply.frozen_ms.max(frozen);
        reply.member_frozen_ms.insert(pid, frozen);
        if let Err(e) = res {
            warn!(pid, error = e, "letting a checkpointed process go failed");
            first_err.get_or_insert(format!("process {pid}: {e}"));
        }
    }
    let rest = LetGo {
        pending: rest,
        leases,
        action,
    };
    // The leases stay held (renewed) until the members left are gone.
    let rest = if rest.pending.is_empty() {
        rest.wait();
        None
    } else {
        Some(rest)
    };
    let res = match first_err {
        Some(e) => Err(e),
        None => Ok(reply),
    };
    (res, rest)
}

/// RESTORE: rebuild the targets frozen on a session thread; their PIDs.
pub async fn restore(
    shared: Arc<Shared>,
    req: pb::RestoreRequest,
) -> Result<pb::RestoreReply, String> {
    let map_addr = cr_rpc::opts::addr_rewrites(&req.map_addr)?;
    let id = req.session.clone();
    start(shared, id, "RESTORE", move |sh, rx, ready| {
        restore_session(sh, req, map_addr, rx, ready)
    })
    .await
}

/// The reset guard of a restore the coordinator releases with its peers.
const RESET_GUARD_SECS: u32 = 10;

fn restore_session(
    shared: &Shared,
    req: pb::RestoreRequest,
    map_addr: Vec<cr_engine::options::AddrRewrite>,
    rx: mpsc::Receiver<Cmd>,
    ready: Reply<pb::RestoreReply>,
) -> String {
    let timeout = Duration::from_millis(u64::from(req.timeout_ms.max(1000)));
    // Members killed here whose exit a FINISH did not wait for may hold
    // what this restore needs (a rolled-back migration's PIDs, ports).
    shared.sessions.wait_exits();
    let opts = RestoreOptions {
        workers: Some(shared.workers),
        map_addr,
        // Released together with their peers: a short guard is enough.
        reset_guard: RESET_GUARD_SECS,
        allow_changed_files: req.allow_changed_files,
        lazy_pages: req.lazy_pages,
        // Restart callbacks behind the job-wide barrier (JOBBACK).
        restart_callbacks_later: req.job_barrier,
        // Stores a lazy fetch left to come (post-copy migration).
        remote_pages: req.lazy_pages.then(|| {
            shared.postcopies.clone() as Arc<dyn cr_engine::kinds::memory::remote::RemoteStores>
        }),
        ..Default::default()
    };
    // Every tree rebuilt at once, each by a tracer thread of its own (which
    // later releases it): the members are independent trees (each in its
    // own namespaces), and their page fills share the page workers.
    let gate = Arc::new(cr_engine::tracer::Gate::new(parallel_trees()));
    let mut starting = Vec::with_capacity(req.targets.len());
    let mut failed = None;
    for t in &req.targets {
        // This image's own rewrites come first (the first match wins).
        let mut opts = opts.clone();
        match cr_rpc::opts::addr_rewrites(&t.map_addr) {
            Ok(mut own) => {
                own.append(&mut opts.map_addr);
                opts.map_addr = own;
            }
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
        let (dir, gate) = (t.dir.clone(), gate.clone());
        let make = move || {
            let _pass = gate.enter();
            cr_engine::restore::prepare(Path::new(&dir), &opts)
                .map_err(|e| format!("{dir}: {}", one_line(&e)))
        };
        match Tracer::start(format!("restore-{}", starting.len()), make) {
            Ok(s) => starting.push(s),
            Err(e) => {
                failed = Some(format!("cannot start a thread to restore {}: {e}", t.dir));
                break;
            }
        }
    }
    let mut readies = Vec::with_capacity(starting.len());
    for s in starting {
        match s.join() {
            Ok(r) => readies.push(r),
            Err(e) => {
                failed.get_or_insert(e.unwrap_or_else(|g| g.to_string()));
            }
        }
    }
    if let Some(msg) = failed {
        cr_engine::tracer::end_all(readies);
        let _ = ready.send(Err(msg.clone()));
        return format!("RESTORE failed ({msg}): nothing of it runs");
    }
    fault::point("restore", shared);
    let pids = readies
        .iter()
        .map(|r| r.run(|r| r.pid()))
        .map(|p| p.wait().unwrap_or(0))
        .collect();
    info!(
        session = req.session,
        job = req.job,
        trees = readies.len(),
        "restored, frozen"
    );
    if ready.send(Ok(pb::RestoreReply { pids })).is_err() {
        cr_engine::tracer::end_all(readies);
        return "the coordinator went away during RESTORE: nothing of it runs".into();
    }
    loop {
        let cmd = match rx.recv_timeout(timeout) {
            Ok(c) => c,
            Err(_) => {
                warn!(
                    session = req.session,
                    "no RELEASE from the coordinator: the restored processes are killed"
                );
                cr_engine::tracer::end_all(readies);
                return "no RELEASE came: nothing of it runs".into();
            }
        };
        match cmd {
            Cmd::Release(r) => {
                fault::point("release", shared);
                let res = release_all(shared, &req, readies);
                let how = match &res {
                    Ok(_) => "released".to_string(),
                    Err(e) => format!("RELEASE failed: {e}"),
                };
                let _ = r.send(res);
                return how;
            }
            Cmd::Abort(_, r) => {
                cr_engine::tracer::end_all(readies);
                info!(session = req.session, "restore aborted; nothing of it runs");
                let _ = r.send(Ok(()));
                return "aborted: nothing of it runs".into();
            }
            other => {
                let name = other.name();
                reply_err(other, format!("{name} of a restore session"));
            }
        }
    }
}

fn reply_err(cmd: Cmd, msg: String) {
    match cmd {
        Cmd::Freeze(r) => drop(r.send(Err(msg))),
        Cmd::Dump(r) => drop(r.send(Err(msg))),
        Cmd::Abort(_, r) => drop(r.send(Err(msg))),
        Cmd::Finish(_, _, r) => drop(r.send(Err(msg))),
        Cmd::Release(r) => drop(r.send(Err(msg))),
    }
}

/// Keep serving the post-copy pages of released tree `pid` (`--lazy-pages`)
/// on a thread of its own until every page is in; a failure has killed
/// the tree (the reaper reports its member gone).
fn serve_lazy(pid: i32, lazy: cr_engine::kinds::memory::lazy::Transfer) {
    if lazy.is_empty() {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name(format!("lazy-{pid}"))
        .spawn(move || match lazy.wait() {
            Ok(s) => info!(
                pid,
                faults = s.faults,
                pushed_mib = s.pushed_bytes >> 20,
                ms = s.ms,
                "post-copy done: every page of the restored tree is in"
            ),
            Err(e) => warn!(pid, "post-copy failed: {}", one_line(&e)),
        });
    if let Err(e) = spawned {
        // The transfer, dropped, killed the tree: nothing would serve it.
        warn!(
            pid,
            "cannot start a thread to serve post-copy pages ({e}): the tree was killed"
        );
    }
}

/// Let every restored tree run, all at once (each from the thread that
/// rebuilt it); they become members of `req.job` (see [`super::jobback`] for `req.job_barrier`).
fn release_all(
    shared: &Shared,
    req: &pb::RestoreRequest,
    readies: Vec<Tracer<cr_engine::restore::Ready>>,
) -> Result<pb::ReleaseReply, String> {
    // The images' network locks (this namespace) in one nft transaction.
    let locks: Vec<String> = readies
        .iter()
        .map(|r| r.run(|r| r.take_netlock()))
        .filter_map(|p| p.wait().ok().flatten())
        .collect();
    if let Err(e) = cr_sys::netlock::unlock_many(None, &locks) {
        warn!(error = %one_line(&e), "cannot remove the images' network locks");
    }
    let mut out = pb::ReleaseReply::default();
    let mut first_err = None;
    // The reset guard's elements expire after RESET_GUARD_SECS; its table
    // goes then.
    shared
        .leases
        .check_guard_after(Duration::from_secs(u64::from(RESET_GUARD_SECS) + 1));
    let pending: Vec<_> = readies
        .into_iter()
        .map(|r| {
            r.end(|mut r| {
                // A coordinated checkpoint saves only the files its member
                // listed: the restored member keeps them listed for the
                // next one.
                let save_file = r.saved_files();
                let lazy = r.take_lazy();
                let dir = r.image_dir().to_path_buf();
                r.release()
                    .map(|pid| {
                        serve_lazy(pid, lazy);
                        (pid, save_file, dir)
                    })
                    .map_err(|e| one_line(&e))
            })
        })
        .collect();
    let mut released = Vec::new();
    for p in pending {
        match p.wait().map_err(|e| e.to_string()).and_then(|r| r) {
            Ok((pid, save_file, dir)) => {
                shared.reaper.watch(pid);
                released.push((pid, dir));
                let (uid, command) = members::describe(pid);
                let m = pb::Member {
                    job: req.job.clone(),
                    pid,
                    uid,
                    command,
                    start_time: members::start_time(pid).unwrap_or(0),
                    save_file,
                    rss: 0,
                };
                out.generation = shared.members.add(m.clone());
                out.members.push(m);
            }
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    if req.job_barrier {
        let limit = Duration::from_millis(u64::from(req.timeout_ms.max(1000)));
        shared.job_back.hold(&req.session, released, limit);
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(out),
    }
}
