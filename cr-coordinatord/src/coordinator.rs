//! The coordinator's state in one place: the catalog, the agents, the
//! node registry, the operations in progress (one per job) and the stop
//! flag; and the read-only views crctl asks for (nodes, jobs, checkpoints,
//! status) plus job settings (Configure). The protocol itself is in
//! [`crate::protocol`], node membership in [`crate::registry`].

use crate::agents::AgentApi;
use crate::catalog::{self, Catalog, Change, JobRecord, State};
use crate::error::Error;
use crate::events::Events;
use crate::registry::{Liveness, Registry};
use cr_rpc::pb;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// What the coordinator is told by its configuration.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Heartbeat period told to agents (the least: see
    /// `max_heartbeats_per_s`).
    pub heartbeat_ms: u32,
    /// No heartbeat this long: the node is down (with the period told,
    /// scaled the same way).
    pub node_timeout: Duration,
    /// Heartbeats a second the coordinator takes at most: with more nodes
    /// than `heartbeat_ms` allows at this rate, the period told to agents
    /// grows with their number (and `node_timeout` with it).
    pub max_heartbeats_per_s: u32,
    /// Default deadline of a checkpoint or restart.
    pub timeout: Duration,
    /// Least default freeze bound of a checkpoint (see
    /// `protocol::default_freeze_bound`).
    pub freeze_timeout: Duration,
}

/// Default of `max_heartbeats_per_s`: at the default period of 1 s, up to
/// 1,000 nodes heartbeat every second; 10,000 every 10 s.
pub const DEFAULT_MAX_HEARTBEATS_PER_S: u32 = 1000;

/// Default of `freeze_timeout_ms`.
pub const DEFAULT_FREEZE_TIMEOUT: Duration = Duration::from_secs(10);

impl Default for Settings {
    fn default() -> Self {
        Settings {
            heartbeat_ms: 1000,
            node_timeout: Duration::from_millis(5000),
            max_heartbeats_per_s: DEFAULT_MAX_HEARTBEATS_PER_S,
            timeout: Duration::from_secs(120),
            freeze_timeout: DEFAULT_FREEZE_TIMEOUT,
        }
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Kinds of operation on a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpKind {
    Checkpoint,
    Restart,
}

impl OpKind {
    /// The kind of its events.
    fn event_kind(self) -> &'static str {
        match self {
            OpKind::Checkpoint => "checkpoint",
            OpKind::Restart => "restart",
        }
    }
}

#[derive(Debug, Clone)]
struct Active {
    kind: OpKind,
    /// The checkpoint (restarted from), once known.
    id: String,
    /// "checkpoint J-3", "restart of J from J-3".
    what: String,
    phase: String,
}

/// The coordinator.
pub struct Coordinator {
    pub(crate) catalog: Arc<Catalog>,
    pub(crate) agents: Arc<dyn AgentApi>,
    pub(crate) settings: Settings,
    pub(crate) registry: Registry,
    active: Mutex<BTreeMap<String, Active>>,
    started: Instant,
    stopping: watch::Sender<bool>,
    /// What happens, for crctl watch and status.
    pub(crate) events: Events,
}

/// The job's slot for one operation; freed on drop.
pub(crate) struct Busy<'a> {
    coord: &'a Coordinator,
    job: String,
}

impl Busy<'_> {
    /// Name the operation (once its checkpoint `id` is known) and its
    /// phase.
    pub(crate) fn set(&self, id: &str, what: &str, phase: &str) {
        let op = {
            let mut a = self.coord.active.lock().unwrap_or_else(|p| p.into_inner());
            a.get_mut(&self.job).map(|op| {
                op.id = id.to_string();
                op.what = what.to_string();
                op.phase = phase.to_string();
                op.clone()
            })
        };
        self.tell(op);
    }

    pub(crate) fn phase(&self, phase: &str) {
        let op = {
            let mut a = self.coord.active.lock().unwrap_or_else(|p| p.into_inner());
            a.get_mut(&self.job).map(|op| {
                op.phase = phase.to_string();
                op.clone()
            })
        };
        self.tell(op);
    }

    /// The operation ended: `phase` ("committed", "aborted", "done",
    /// "failed") and one line.
    pub(crate) fn end(&self, phase: &str, text: String) {
        let op = self
            .coord
            .active
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&self.job)
            .cloned();
        if let Some(op) = op {
            self.coord
                .events
                .op_end(op.kind.event_kind(), &self.job, &op.id, phase, text);
        }
    }

    fn tell(&self, op: Option<Active>) {
        if let Some(op) = op {
            self.coord.events.op_phase(
                op.kind.event_kind(),
                &self.job,
                &op.id,
                &op.what,
                &op.phase,
            );
        }
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.coord
            .active
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.job);
    }
}

impl Coordinator {
    pub fn new(catalog: Arc<Catalog>, agents: Arc<dyn AgentApi>, settings: Settings) -> Self {
        Coordinator {
            catalog,
            agents,
            settings,
            registry: Registry::default(),
            active: Mutex::new(BTreeMap::new()),
            started: Instant::now(),
            stopping: watch::channel(false).0,
            events: Events::default(),
        }
    }

    pub fn catalog(&self) -> &Arc<Catalog> {
        &self.catalog
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// Take the job's slot, or say what holds it.
    pub(crate) fn begin(&self, job: &str, kind: OpKind, what: String) -> Result<Busy<'_>, Error> {
        if *self.stopping.borrow() {
            return Err(Error::Stopping);
        }
        let mut a = self.active.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(op) = a.get(job) {
            return Err(Error::Busy {
                job: job.to_string(),
                what: op.what.clone(),
            });
        }
        a.insert(
            job.to_string(),
            Active {
                kind,
                id: String::new(),
                what,
                phase: "starting".into(),
            },
        );
        Ok(Busy {
            coord: self,
            job: job.to_string(),
        })
    }

    /// Whether an operation on `job` is in progress.
    pub fn is_busy(&self, job: &str) -> bool {
        self.active
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(job)
    }

    /// Whether the checkpoint `id` is being run right now.
    pub(crate) fn is_active_checkpoint(&self, id: &str) -> bool {
        self.active
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .any(|op| op.kind == OpKind::Checkpoint && op.what == format!("checkpoint {id}"))
    }

    fn active_kind(&self, job: &str) -> Option<OpKind> {
        self.active
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(job)
            .map(|op| op.kind)
    }

    /// Resolves once [`Coordinator::shutdown`] was called.
    pub(crate) async fn stopped(&self) {
        let mut rx = self.stopping.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }

    pub fn is_stopping(&self) -> bool {
        *self.stopping.borrow()
    }

    /// Refuse new operations, make those in progress end (they abort
    /// unless committed, and record their decision), and wait for them
    /// (at most `grace`).
    pub async fn shutdown(&self, grace: Duration) {
        self.stopping.send_replace(true);
        let t0 = Instant::now();
        loop {
            let left: Vec<String> = self
                .active
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .values()
                .map(|op| format!("{} ({})", op.what, op.phase))
                .collect();
            if left.is_empty() {
                return;
            }
            if t0.elapsed() >= grace {
                tracing::warn!(ops = ?left, "stopping with operations still in progress");
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Change job `job`'s record in one catalog transaction.
    pub(crate) fn change_job(
        &self,
        job: &str,
        f: impl FnOnce(&mut JobRecord),
    ) -> Result<(), Error> {
        self.catalog.update(|s| {
            let mut j = s
                .jobs
                .get(job)
                .cloned()
                .ok_or_else(|| Error::UnknownJob { job: job.into() })?;
            f(&mut j);
            Ok::<_, Error>((vec![Change::Job(j)], ()))
        })
    }

    /// Which nodes are up, now.
    pub(crate) fn liveness(&self) -> Liveness {
        self.registry.snapshot()
    }

    // ------------------------------------------------------------ views

    pub fn nodes(&self) -> pb::NodesReply {
        let live = self.liveness();
        let nodes = self.catalog.read(|s| {
            s.nodes
                .values()
                .map(|n| pb::NodeInfo {
                    name: n.name.clone(),
                    agent_addr: n.agent_addr.clone(),
                    addresses: n.addresses.clone(),
                    state: if live.is_up(&n.name) { "up" } else { "down" }.into(),
                    last_seen_unix_ms: live
                        .last_seen_unix_ms(&n.name)
                        .unwrap_or(n.registered_unix_ms),
                    members: s
                        .on_node(&n.name)
                        .map(|(j, ks)| ks.iter().filter(|&&k| j.members[k].alive).count())
                        .sum::<usize>() as u32,
                    version: n.version.clone(),
                    drained: n.drained,
                    capacity: live.capacity(&n.name).cloned(),
                })
                .collect()
        });
        pb::NodesReply { nodes }
    }

    fn job_info(&self, j: &JobRecord, s: &State, live: &Liveness) -> pb::JobInfo {
        let procs: Vec<pb::ProcInfo> = j
            .members
            .iter()
            .map(|m| pb::ProcInfo {
                node: m.node.clone(),
                pid: m.pid,
                uid: m.uid,
                command: m.command.clone(),
                alive: m.alive && live.is_up(&m.node),
            })
            .collect();
        let alive = procs.iter().filter(|p| p.alive).count();
        let state = match self.active_kind(&j.name) {
            Some(OpKind::Checkpoint) => "checkpointing",
            Some(OpKind::Restart) => "restarting",
            None if alive > 0 && alive == procs.len() => "running",
            None if alive > 0 => "partial",
            None => "stopped",
        };
        let committed: Vec<&catalog::CheckpointRecord> = s
            .job_checkpoints(&j.name)
            .filter(|c| c.state() == catalog::state::COMMITTED)
            .collect();
        pb::JobInfo {
            name: j.name.clone(),
            state: state.into(),
            procs,
            interval_secs: j.interval_secs,
            keep: j.keep,
            external: j.external.clone(),
            incremental: j.incremental,
            freeze_timeout_ms: j.freeze_timeout_ms,
            replicas: j.replicas,
            pre_copy: j.pre_copy,
            save_files: j.save_files,
            mode: if j.mode.is_empty() {
                catalog::MODE_COORDINATED.into()
            } else {
                j.mode.clone()
            },
            last_checkpoint: committed
                .last()
                .map(|c| c.id().to_string())
                .unwrap_or_default(),
            checkpoints: committed.len() as u32,
        }
    }

    pub fn jobs(&self) -> pb::JobsReply {
        let live = self.liveness();
        let jobs = self.catalog.read(|s| {
            s.jobs
                .values()
                .map(|j| self.job_info(j, s, &live))
                .collect()
        });
        pb::JobsReply { jobs }
    }

    pub fn job(&self, job: &str) -> Result<pb::JobInfo, Error> {
        let live = self.liveness();
        self.catalog
            .read(|s| s.jobs.get(job).map(|j| self.job_info(j, s, &live)))
            .ok_or_else(|| Error::UnknownJob { job: job.into() })
    }

    /// The job's committed checkpoints (`all`: every one), oldest first.
    pub fn checkpoints(&self, job: &str, all: bool) -> Result<pb::CheckpointsReply, Error> {
        self.catalog.read(|s| {
            if !s.jobs.contains_key(job) {
                return Err(Error::UnknownJob { job: job.into() });
            }
            Ok(pb::CheckpointsReply {
                checkpoints: s
                    .job_checkpoints(job)
                    .filter(|c| all || c.state() == catalog::state::COMMITTED)
                    .map(|c| c.info().clone())
                    .collect(),
            })
        })
    }

    /// One checkpoint by id.
    pub fn checkpoint_info(&self, id: &str) -> Option<pb::CheckpointInfo> {
        self.catalog
            .read(|s| s.checkpoint(id).map(|c| c.info().clone()))
    }

    pub fn status(&self) -> pb::StatusReply {
        let live = self.liveness();
        let active = self
            .active
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(job, op)| format!("{} of {job}: {}", op.what, op.phase))
            .collect();
        let (nodes, nodes_up, jobs, checkpoints) = self.catalog.read(|s| {
            (
                s.nodes.len() as u32,
                s.nodes.keys().filter(|n| live.is_up(n)).count() as u32,
                s.jobs.len() as u32,
                s.checkpoints
                    .values()
                    .flat_map(|m| m.values())
                    .filter(|c| c.state() == catalog::state::COMMITTED)
                    .count() as u32,
            )
        });
        pb::StatusReply {
            version: env!("CARGO_PKG_VERSION").into(),
            uptime_ms: self.started.elapsed().as_millis() as u64,
            nodes,
            nodes_up,
            jobs,
            checkpoints,
            active,
            db: self.catalog.path().display().to_string(),
            migrations: self.events.migrations(),
            drains: self.events.drains(),
        }
    }

    /// Change a job's settings (the fields given); the job must exist.
    pub fn configure(&self, req: &pb::ConfigureRequest) -> Result<pb::JobInfo, Error> {
        if let Some(x) = req.external.as_deref() {
            if x != catalog::EXTERNAL_ABORT && x != catalog::EXTERNAL_ALLOW {
                return Err(Error::Invalid {
                    what: format!("external policy {x:?}: expected \"abort\" or \"allow\""),
                });
            }
        }
        if let Some(x) = req.mode.as_deref() {
            let modes = [
                catalog::MODE_COORDINATED,
                catalog::MODE_NON_BLOCKING,
                catalog::MODE_UNCOORDINATED,
            ];
            if !modes.contains(&x) {
                return Err(Error::Invalid {
                    what: format!(
                        "mode {x:?}: expected \"coordinated\", \"non-blocking\" or \"uncoordinated\""
                    ),
                });
            }
        }
        self.update_job(&req.job, |j| {
            if let Some(v) = req.interval_secs {
                j.interval_secs = v;
            }
            if let Some(v) = req.keep {
                j.keep = v;
            }
            if let Some(v) = &req.external {
                j.external = v.clone();
            }
            if let Some(v) = req.incremental {
                j.incremental = v;
            }
            if let Some(v) = req.freeze_timeout_ms {
                j.freeze_timeout_ms = v;
            }
            if let Some(v) = req.replicas {
                j.replicas = v;
            }
            if let Some(v) = req.save_files {
                j.save_files = v;
            }
            if let Some(v) = req.pre_copy {
                j.pre_copy = v;
            }
            if let Some(v) = &req.mode {
                j.mode = v.clone();
            }
        })
    }

    /// Remove members (node, pid) from `job`: they exited.
    pub(crate) fn drop_members(&self, job: &str, gone: &[(String, i32)]) -> Result<(), Error> {
        self.catalog.update(|s| {
            let Some(j) = s.jobs.get(job) else {
                return Ok((vec![], ()));
            };
            let mut j = j.clone();
            let before = j.members.len();
            j.members
                .retain(|m| !gone.iter().any(|(n, p)| *n == m.node && *p == m.pid));
            if j.members.len() == before {
                return Ok((vec![], ()));
            }
            tracing::info!(job, members = ?gone, "members dropped from the job (they exited)");
            Ok::<_, Error>((vec![Change::Job(j)], ()))
        })
    }

    /// Turn incremental checkpoints of a job on or off.
    pub fn set_incremental(&self, job: &str, on: bool) -> Result<pb::JobInfo, Error> {
        self.update_job(job, |j| j.incremental = on)
    }

    fn update_job(&self, job: &str, f: impl FnOnce(&mut JobRecord)) -> Result<pb::JobInfo, Error> {
        self.change_job(job, |j| {
            let before = j.clone();
            f(j);
            if *j != before {
                tracing::info!(
                    job = %j.name,
                    interval_secs = j.interval_secs,
                    keep = j.keep,
                    external = %j.external,
                    incremental = j.incremental,
                    replicas = j.replicas,
                    pre_copy = j.pre_copy,
                    mode = %j.mode,
                    "job settings changed"
                );
            }
        })?;
        self.job(job)
    }
}
