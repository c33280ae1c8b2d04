//! Nodes and their members: Register and Heartbeat. A node is up while it
//! heartbeats (within `node_timeout`); only nodes that registered since
//! this coordinator started count (a heartbeat from any other node is
//! answered with `register_again`). The members a node reports are its
//! live members: members of that node it no longer reports are marked not
//! alive, new ones are added to their job (created with default settings on
//! first use). Reports older (by `generation`) than the last one seen are
//! ignored; a Register is always taken (the agent may have restarted).
//!
//! A heartbeat whose members are already what the catalog says of its node
//! (and no report of that node is waiting to be written) writes nothing and
//! does not wait for the report writer: only its liveness (last seen,
//! capacity, members' resident bytes) is kept, in memory. Nothing of a
//! heartbeat but its members is persisted.
//!
//! When a node registers (or comes back up), FINISH is sent again for the
//! committed checkpoints it has not acknowledged.

use crate::catalog::{CatalogError, Change, JobRecord, MemberRecord, NodeRecord, State};
use crate::coordinator::{now_unix_ms, Coordinator};
use crate::error::Error;
use cr_rpc::pb;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// How long a re-sent FINISH may take.
const FINISH_RESEND_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
struct Live {
    last_seen: Instant,
    last_seen_unix_ms: u64,
    generation: u64,
    /// "node is down" was logged.
    down_logged: bool,
    /// The node's last reported capacity.
    capacity: Option<pb::NodeCapacity>,
    /// Resident bytes of each member (by PID) at the last report.
    rss: HashMap<i32, u64>,
    /// No heartbeat this long: down (from the period it was told last,
    /// see [`pace`]).
    timeout: Duration,
}

/// The heartbeat period to tell an agent when `nodes` are registered, and
/// the time without a heartbeat after which its node is down: the
/// configured ones, both stretched alike once `nodes` heartbeats a period
/// would be more than `max_heartbeats_per_s` (10,000 agents heartbeating
/// every second took half of the coordinator's CPU and doubled its rounds).
pub(crate) fn pace(settings: &crate::coordinator::Settings, nodes: usize) -> (u32, Duration) {
    let least = u64::from(settings.heartbeat_ms.max(1));
    let rate = u64::from(settings.max_heartbeats_per_s.max(1));
    let needed = (nodes as u64).saturating_mul(1000).div_ceil(rate);
    let period = least.max(needed).min(u64::from(u32::MAX));
    let timeout = settings.node_timeout.as_millis() as u64 * period / least;
    (period as u32, Duration::from_millis(timeout))
}

/// Members' resident bytes by PID, from a report.
fn rss_of(members: &[pb::Member]) -> HashMap<i32, u64> {
    members.iter().map(|m| (m.pid, m.rss)).collect()
}

/// Liveness of the nodes registered since the coordinator started.
#[derive(Default)]
pub(crate) struct Registry {
    nodes: Mutex<HashMap<String, Live>>,
    reports: Reports,
}

/// A snapshot of which nodes are up.
#[derive(Debug, Clone)]
pub(crate) struct Liveness {
    /// Per node: time since its last heartbeat, that heartbeat's wall
    /// time, its timeout.
    nodes: HashMap<String, (Duration, u64, Duration)>,
    capacity: HashMap<String, pb::NodeCapacity>,
    rss: HashMap<String, HashMap<i32, u64>>,
}

impl Liveness {
    pub(crate) fn is_up(&self, node: &str) -> bool {
        self.nodes
            .get(node)
            .is_some_and(|(age, _, timeout)| age <= timeout)
    }

    pub(crate) fn last_seen_unix_ms(&self, node: &str) -> Option<u64> {
        self.nodes.get(node).map(|(_, t, _)| *t)
    }

    /// `node`'s last reported capacity.
    pub(crate) fn capacity(&self, node: &str) -> Option<&pb::NodeCapacity> {
        self.capacity.get(node)
    }

    /// Resident bytes of member `pid` of `node` at its last report (0:
    /// unknown).
    pub(crate) fn rss(&self, node: &str, pid: i32) -> u64 {
        self.rss
            .get(node)
            .and_then(|m| m.get(&pid))
            .copied()
            .unwrap_or(0)
    }

    /// Why `node` is down.
    pub(crate) fn down_reason(&self, node: &str) -> String {
        match self.nodes.get(node) {
            Some((age, _, _)) => format!("no heartbeat for {} s", age.as_secs()),
            None => "its agent has not registered since the coordinator started".into(),
        }
    }
}

impl Registry {
    pub(crate) fn snapshot(&self) -> Liveness {
        let now = Instant::now();
        let reg = self.nodes.lock().unwrap_or_else(|p| p.into_inner());
        let nodes = reg
            .iter()
            .map(|(n, l)| {
                let age = now - l.last_seen;
                (n.clone(), (age, l.last_seen_unix_ms, l.timeout))
            })
            .collect();
        let capacity = reg
            .iter()
            .filter_map(|(n, l)| Some((n.clone(), l.capacity.clone()?)))
            .collect();
        let rss = reg
            .iter()
            .map(|(n, l)| (n.clone(), l.rss.clone()))
            .collect();
        Liveness {
            nodes,
            capacity,
            rss,
        }
    }

    /// Reports older than `generation` from `node` are ignored from now on.
    pub(crate) fn raise_generation(&self, node: &str, generation: u64) {
        if let Some(l) = self
            .nodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(node)
        {
            l.generation = l.generation.max(generation);
        }
    }

    /// How many reports of `node` were queued for the catalog so far.
    #[cfg(test)]
    pub(crate) fn reports_queued(&self, node: &str) -> u64 {
        self.reports.pending().counts.get(node).map_or(0, |c| c.0)
    }

    /// Nodes that went down since the last call (each reported once per outage).
    pub(crate) fn newly_down(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (n, l) in self
            .nodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter_mut()
        {
            if !l.down_logged && l.last_seen.elapsed() > l.timeout {
                l.down_logged = true;
                out.push(n.clone());
            }
        }
        out
    }
}

/// What a Register says of its node besides its members.
struct Registration {
    agent_addr: String,
    addresses: Vec<String>,
    version: String,
    at_unix_ms: u64,
}

/// A node's report (Register or Heartbeat) waiting for the next catalog
/// transaction.
struct Report {
    node: String,
    registration: Option<Registration>,
    members: Vec<pb::Member>,
    done: oneshot::Sender<Result<(), String>>,
}

/// Reports not written yet, and who writes them: the reports that come
/// while one transaction is written go together into the next one (group
/// commit), instead of one durable transaction each (10,000 agents
/// registering at once, each rewriting its job's list of members).
#[derive(Default)]
pub(crate) struct Reports {
    pending: Arc<Mutex<Pending>>,
    writer: tokio::sync::Mutex<()>,
}

/// The reports waiting for the writer, and per node how many of its
/// reports were queued and how many of those were written (or failed) so
/// far: equal, the catalog holds every report of the node.
#[derive(Default)]
struct Pending {
    reports: Vec<Report>,
    counts: HashMap<String, (u64, u64)>,
}

impl Reports {
    fn pending(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How many reports of `node` were queued so far, when every one of
    /// them is written (the catalog shows the last); `None` while some
    /// are not.
    fn settled(&self, node: &str) -> Option<u64> {
        match self.pending().counts.get(node) {
            Some(&(queued, written)) => (queued == written).then_some(queued),
            None => Some(0),
        }
    }
}

/// Whether a report of `node` with members `reported` would change nothing
/// in the catalog: each member of the node there is alive exactly when it
/// is reported, and each reported member is there (see [`sync_members`],
/// whose changes this foresees without making them).
fn members_unchanged(s: &State, node: &str, reported: &[pb::Member]) -> bool {
    for (j, ks) in s.on_node(node) {
        for &k in ks {
            let m = &j.members[k];
            let found = reported.iter().any(|r| r.job == j.name && m.is(node, r));
            if m.alive != found {
                return false;
            }
        }
    }
    // A member without a job name is warned of by sync_members.
    reported.iter().all(|r| {
        !r.job.is_empty()
            && s.on_node(node)
                .any(|(j, ks)| j.name == r.job && ks.iter().any(|&k| j.members[k].is(node, r)))
    })
}

/// The jobs a batch of reports changed so far, each with the positions of
/// its members by node (made when the job is first changed).
#[derive(Default)]
struct Working {
    jobs: BTreeMap<String, (JobRecord, HashMap<String, Vec<usize>>)>,
}

impl Working {
    fn job(&mut self, s: &State, name: &str) -> &mut (JobRecord, HashMap<String, Vec<usize>>) {
        self.jobs.entry(name.to_string()).or_insert_with(|| {
            let j = s.jobs.get(name).cloned().unwrap_or_else(|| {
                tracing::info!(job = %name, "new job");
                JobRecord::new(name)
            });
            let mut at: HashMap<String, Vec<usize>> = HashMap::new();
            for (k, m) in j.members.iter().enumerate() {
                at.entry(m.node.clone()).or_default().push(k);
            }
            (j, at)
        })
    }

    /// The members of `node` in job `name` as changed so far: (member,
    /// position).
    fn members_on<'a>(
        &'a self,
        s: &'a State,
        node: &str,
    ) -> Vec<(&'a str, &'a JobRecord, Vec<usize>)> {
        let mut out: Vec<(&str, &JobRecord, Vec<usize>)> = s
            .on_node(node)
            .filter(|(j, _)| !self.jobs.contains_key(&j.name))
            .map(|(j, ks)| (j.name.as_str(), j, ks.to_vec()))
            .collect();
        for (name, (j, at)) in &self.jobs {
            if let Some(ks) = at.get(node) {
                out.push((name.as_str(), j, ks.clone()));
            }
        }
        out
    }
}

/// Make the members of `node` in the jobs what it reports, on top of the
/// changes `w` of the reports before it. Only the node's own members are
/// looked at (the catalog's index by node).
fn sync_members(s: &State, w: &mut Working, node: &str, reported: &[pb::Member]) {
    let mut seen = vec![false; reported.len()];
    // (job, position, alive now) of the members whose liveness changes.
    let mut flips: Vec<(String, usize, bool)> = Vec::new();
    for (name, j, ks) in w.members_on(s, node) {
        for k in ks {
            let m = &j.members[k];
            let found = reported.iter().position(|r| r.job == name && m.is(node, r));
            if let Some(i) = found {
                seen[i] = true;
            }
            let alive = found.is_some();
            if m.alive != alive {
                if !alive {
                    tracing::info!(job = %name, node, pid = m.pid, "member is gone");
                }
                flips.push((name.to_string(), k, alive));
            }
        }
    }
    for (name, k, alive) in flips {
        w.job(s, &name).0.members[k].alive = alive;
    }
    for (r, _) in reported.iter().zip(&seen).filter(|(_, s)| !**s) {
        if r.job.is_empty() {
            tracing::warn!(node, pid = r.pid, "member without a job name ignored");
            continue;
        }
        let (j, at) = w.job(s, &r.job);
        let mine = at.get(node).map_or(&[][..], Vec::as_slice);
        if mine.iter().any(|&k| j.members[k].is(node, r)) {
            continue; // reported twice
        }
        // A job none of whose members lives any more starts afresh.
        if !j.members.is_empty() && j.members.iter().all(|m| !m.alive) {
            j.members.clear();
            at.clear();
        }
        tracing::info!(job = %r.job, node, pid = r.pid, command = %r.command, "new member");
        at.entry(node.to_string())
            .or_default()
            .push(j.members.len());
        j.members.push(MemberRecord::from_member(node, r));
    }
}

/// The catalog changes of a batch of reports, in their order.
fn report_changes(
    s: &State,
    batch: &[(String, Option<Registration>, Vec<pb::Member>)],
) -> Vec<Change> {
    let mut changes = Vec::new();
    let mut w = Working::default();
    for (node, registration, members) in batch {
        if let Some(r) = registration {
            changes.push(Change::Node(NodeRecord {
                name: node.clone(),
                agent_addr: r.agent_addr.clone(),
                addresses: r.addresses.clone(),
                version: r.version.clone(),
                registered_unix_ms: r.at_unix_ms,
                // A drain outlives the agent's restarts.
                drained: s.nodes.get(node).is_some_and(|n| n.drained),
            }));
        }
        sync_members(s, &mut w, node, members);
    }
    changes.extend(w.jobs.into_values().map(|(j, _)| Change::Job(j)));
    changes
}

impl Coordinator {
    /// Queue a node's report for the next catalog transaction; the
    /// receiver says how its write went.
    fn queue_report(
        &self,
        node: &str,
        registration: Option<Registration>,
        members: Vec<pb::Member>,
    ) -> oneshot::Receiver<Result<(), String>> {
        let (done, rx) = oneshot::channel();
        let mut pending = self.registry.reports.pending();
        pending.counts.entry(node.to_string()).or_default().0 += 1;
        pending.reports.push(Report {
            node: node.to_string(),
            registration,
            members,
            done,
        });
        rx
    }

    /// Wait until the report of `rx` is written: by this call, with every
    /// report queued by then in one transaction, or by the call that took
    /// it in its own.
    async fn written(&self, rx: oneshot::Receiver<Result<(), String>>) -> Result<(), Error> {
        {
            let _writer = self.registry.reports.writer.lock().await;
            let batch = std::mem::take(&mut self.registry.reports.pending().reports);
            if !batch.is_empty() {
                let (reports, done): (Vec<_>, Vec<_>) = batch
                    .into_iter()
                    .map(|r| ((r.node, r.registration, r.members), r.done))
                    .unzip();
                let catalog = self.catalog.clone();
                let pending = self.registry.reports.pending.clone();
                // A durable write: not on the runtime's threads. Counted
                // there, so that it is even if this call is dropped.
                let res = tokio::task::spawn_blocking(move || {
                    let res = catalog
                        .update(|s| Ok::<_, Error>((report_changes(s, &reports), ())))
                        .map_err(|e| e.to_string());
                    let mut pending = pending.lock().unwrap_or_else(|p| p.into_inner());
                    for (node, _, _) in reports {
                        pending.counts.entry(node).or_default().1 += 1;
                    }
                    res
                })
                .await
                .unwrap_or_else(|e| Err(format!("the catalog write failed: {e}")));
                for d in done {
                    let _ = d.send(res.clone());
                }
            }
        }
        match rx.await {
            Ok(r) => r.map_err(|what| Error::Catalog(CatalogError::Batch(what))),
            Err(_) => Err(Error::Catalog(CatalogError::Batch(
                "the report was dropped unwritten".into(),
            ))),
        }
    }

    /// An agent (re)registers: record its node and members.
    pub async fn register(
        self: &Arc<Self>,
        req: pb::RegisterRequest,
    ) -> Result<pb::RegisterReply, Error> {
        if req.node.is_empty() || req.agent_addr.is_empty() {
            return Err(Error::Invalid {
                what: "Register needs a node name and an agent address".into(),
            });
        }
        let now = now_unix_ms();
        let was_up = self
            .registry
            .nodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&req.node)
            .is_some_and(|l| l.last_seen.elapsed() <= l.timeout);
        let rx = self.queue_report(
            &req.node,
            Some(Registration {
                agent_addr: req.agent_addr.clone(),
                addresses: req.addresses.clone(),
                version: req.version.clone(),
                at_unix_ms: now,
            }),
            req.members.clone(),
        );
        self.written(rx).await?;
        let heartbeat_ms = {
            let mut reg = self
                .registry
                .nodes
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let known = reg.len() + usize::from(!reg.contains_key(&req.node));
            let (period, timeout) = pace(&self.settings, known);
            reg.insert(
                req.node.clone(),
                Live {
                    last_seen: Instant::now(),
                    last_seen_unix_ms: now,
                    generation: req.generation,
                    down_logged: false,
                    capacity: req.capacity.clone(),
                    rss: rss_of(&req.members),
                    timeout,
                },
            );
            period
        };
        self.agents.reset(&req.node);
        tracing::info!(
            node = %req.node,
            agent = %req.agent_addr,
            addresses = ?req.addresses,
            members = req.members.len(),
            version = %req.version,
            "node registered"
        );
        if !was_up {
            self.events.node(&req.node, "up", "registered");
        }
        self.resend_finish(&req.node);
        self.resend_abort(&req.node);
        Ok(pb::RegisterReply {
            heartbeat_ms,
            drained: self.is_drained(&req.node),
        })
    }

    /// An agent's heartbeat with its current members.
    pub async fn heartbeat(
        self: &Arc<Self>,
        req: pb::HeartbeatRequest,
    ) -> Result<pb::HeartbeatReply, Error> {
        let came_back;
        let queued;
        let heartbeat_ms;
        // Nothing to write when the catalog already shows these members
        // and holds every report of the node queued so far (a look at the
        // catalog in memory, outside the registry's lock).
        let unchanged = self.registry.reports.settled(&req.node).filter(|_| {
            self.catalog
                .read(|s| members_unchanged(s, &req.node, &req.members))
        });
        {
            let mut reg = self
                .registry
                .nodes
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let known = reg.len();
            let Some(live) = reg.get_mut(&req.node) else {
                tracing::debug!(node = %req.node, "heartbeat from an unregistered node");
                return Ok(pb::HeartbeatReply {
                    register_again: true,
                    ..Default::default()
                });
            };
            came_back = live.last_seen.elapsed() > live.timeout;
            // The period grows as nodes join: told on every heartbeat, and
            // this node's timeout follows what it was told.
            let (period, timeout) = pace(&self.settings, known);
            heartbeat_ms = period;
            live.timeout = timeout;
            live.last_seen = Instant::now();
            live.last_seen_unix_ms = now_unix_ms();
            live.down_logged = false;
            if req.capacity.is_some() {
                live.capacity = req.capacity.clone();
            }
            if req.generation < live.generation {
                tracing::debug!(
                    node = %req.node,
                    generation = req.generation,
                    last = live.generation,
                    "stale member report ignored"
                );
                queued = None;
            } else {
                live.generation = req.generation;
                live.rss = rss_of(&req.members);
                if unchanged.is_some() && self.registry.reports.settled(&req.node) == unchanged {
                    // No report of the node was queued since the look.
                    queued = None;
                } else {
                    // Queued under the lock: reports are written in the
                    // order of their generations.
                    queued = Some(self.queue_report(&req.node, None, req.members));
                }
            }
        }
        if let Some(rx) = queued {
            self.written(rx).await?;
        }
        self.events.transfers(&req.node, &req.transfers);
        if came_back {
            tracing::info!(node = %req.node, "node is up again");
            self.events.node(&req.node, "up", "heartbeats again");
            self.resend_finish(&req.node);
            self.resend_abort(&req.node);
        }
        Ok(pb::HeartbeatReply {
            register_again: false,
            drained: self.is_drained(&req.node),
            heartbeat_ms,
        })
    }

    /// Send FINISH again to `node` for the committed checkpoints it has not
    /// acknowledged (in the background).
    pub(crate) fn resend_finish(self: &Arc<Self>, node: &str) {
        // Only the ids: a checkpoint of 10,000 images is not copied for
        // each of its 10,000 agents registering.
        let pending: Vec<(String, i32)> = self.catalog.read(|s| {
            s.checkpoints
                .values()
                .flat_map(|m| m.values())
                .filter(|c| !c.finished && c.state() == crate::catalog::state::COMMITTED)
                // The one being run (FINISH not sent yet) first: cheaper
                // than a look through its images.
                .filter(|c| !self.is_active_checkpoint(c.id()))
                .filter(|c| {
                    c.info().images.iter().any(|i| i.node == node)
                        && !c.finished_nodes.iter().any(|n| n == node)
                        // FINISH failed there and crctl said so: never again.
                        && !c.info().unfinished.iter().any(|n| n == node)
                })
                .map(|c| (c.id().to_string(), c.info().after))
                .collect()
        });
        if pending.is_empty() {
            return;
        }
        let me = self.clone();
        let node = node.to_string();
        tokio::spawn(async move {
            for (id, after) in pending {
                let req = pb::FinishRequest {
                    session: id.clone(),
                    after,
                    ..Default::default()
                };
                match tokio::time::timeout(FINISH_RESEND_TIMEOUT, me.agents.finish(&node, req))
                    .await
                {
                    Ok(Ok(_)) => {
                        tracing::info!(checkpoint = %id, node = %node, "FINISH acknowledged (sent again)");
                        if let Err(e) = me.record_finish_ack(&id, &node) {
                            tracing::error!(checkpoint = %id, "{e}");
                        }
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(checkpoint = %id, node = %node, "FINISH sent again failed: {e}");
                        // The agent let its processes run on: recorded, and
                        // never sent again.
                        if let Err(e) = me.record_finish_failure(&id, &node, &e) {
                            tracing::error!(checkpoint = %id, "{e}");
                        }
                    }
                    Err(_) => {
                        tracing::warn!(checkpoint = %id, node = %node, "FINISH sent again: no reply")
                    }
                }
            }
        });
    }

    /// Send ABORT to `node` for the checkpoints that were in progress when
    /// the coordinator last stopped (in the background): an agent still
    /// holding their processes frozen lets them run at once instead of
    /// waiting for its session timeout. Unknown sessions are a no-op.
    pub(crate) fn resend_abort(self: &Arc<Self>, node: &str) {
        let ids: Vec<String> = self.catalog.aborted_at_open().to_vec();
        if ids.is_empty() {
            return;
        }
        let me = self.clone();
        let node = node.to_string();
        tokio::spawn(async move {
            for id in ids {
                let req = pb::SessionRequest {
                    session: id.clone(),
                };
                match tokio::time::timeout(FINISH_RESEND_TIMEOUT, me.agents.abort(&node, req)).await
                {
                    Ok(Ok(_)) => {
                        tracing::debug!(checkpoint = %id, node = %node, "ABORT sent after the restart")
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(checkpoint = %id, node = %node, "ABORT after the restart failed: {e}")
                    }
                    Err(_) => {
                        tracing::warn!(checkpoint = %id, node = %node, "ABORT after the restart: no reply")
                    }
                }
            }
        });
    }

    fn record_finish_failure(&self, id: &str, node: &str, why: &str) -> Result<(), Error> {
        self.catalog.update(|s| {
            let Some(c) = s.checkpoint(id) else {
                return Ok((vec![], ()));
            };
            let mut c = c.clone();
            if c.info().unfinished.iter().any(|n| n == node) {
                return Ok((vec![], ()));
            }
            let info = c.info_mut();
            info.unfinished.push(node.to_string());
            info.notes.push(format!(
                "{node} could not finish: its members run on ({why})"
            ));
            c.finished = c.nodes().iter().all(|n| {
                c.finished_nodes.iter().any(|f| f == n)
                    || c.info().unfinished.iter().any(|f| f == n)
            });
            Ok((vec![Change::Checkpoint(c)], ()))
        })
    }

    fn record_finish_ack(&self, id: &str, node: &str) -> Result<(), Error> {
        self.catalog.update(|s| {
            let Some(c) = s.checkpoint(id) else {
                return Ok((vec![], ()));
            };
            let mut c = c.clone();
            if !c.finished_nodes.iter().any(|n| n == node) {
                c.finished_nodes.push(node.to_string());
            }
            c.finished = c
                .nodes()
                .iter()
                .all(|n| c.finished_nodes.iter().any(|f| f == n));
            Ok((vec![Change::Checkpoint(c)], ()))
        })
    }
}
