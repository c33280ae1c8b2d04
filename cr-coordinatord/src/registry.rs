//! Nodes and their members: Register and Heartbeat. A node is up while it
//! heartbeats (within `node_timeout`); only nodes that registered since
//! this coordinator started count (a heartbeat from any other node is
//! answered with `register_again`). The members a node reports are its
//! live members: members of that node it no longer reports are marked not
//! alive, new ones are added to their job (created with default settings on
//! first use). Reports older (by `generation`) than the last one seen are
//! ignored; a Register is always taken (the agent may have restarted).
//!
//! When a node registers (or comes back up), FINISH is sent again for the
//! committed checkpoints it has not acknowledged.

use crate::catalog::{Change, JobRecord, MemberRecord, NodeRecord, State};
use crate::coordinator::{now_unix_ms, Coordinator};
use crate::error::Error;
use cr_rpc::pb;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a re-sent FINISH may take.
const FINISH_RESEND_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
struct Live {
    last_seen: Instant,
    last_seen_unix_ms: u64,
    generation: u64,
    /// "node is down" was logged.
    down_logged: bool,
}

/// Liveness of the nodes registered since the coordinator started.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    nodes: Mutex<HashMap<String, Live>>,
}

/// A snapshot of which nodes are up.
#[derive(Debug, Clone)]
pub(crate) struct Liveness {
    nodes: HashMap<String, (Duration, u64)>,
    timeout: Duration,
}

impl Liveness {
    pub(crate) fn is_up(&self, node: &str) -> bool {
        self.nodes
            .get(node)
            .is_some_and(|(age, _)| *age <= self.timeout)
    }

    pub(crate) fn last_seen_unix_ms(&self, node: &str) -> Option<u64> {
        self.nodes.get(node).map(|(_, t)| *t)
    }

    /// Why `node` is down.
    pub(crate) fn down_reason(&self, node: &str) -> String {
        match self.nodes.get(node) {
            Some((age, _)) => format!("no heartbeat for {} s", age.as_secs()),
            None => "its agent has not registered since the coordinator started".into(),
        }
    }
}

impl Registry {
    pub(crate) fn snapshot(&self, timeout: Duration) -> Liveness {
        let now = Instant::now();
        let nodes = self
            .nodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(n, l)| (n.clone(), (now - l.last_seen, l.last_seen_unix_ms)))
            .collect();
        Liveness { nodes, timeout }
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

    /// Nodes that went down since the last call (each reported once per outage).
    pub(crate) fn newly_down(&self, timeout: Duration) -> Vec<String> {
        let mut out = Vec::new();
        for (n, l) in self
            .nodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter_mut()
        {
            if !l.down_logged && l.last_seen.elapsed() > timeout {
                l.down_logged = true;
                out.push(n.clone());
            }
        }
        out
    }
}

/// The catalog changes that make the jobs' members on `node` what it reports.
pub(crate) fn sync_members(s: &State, node: &str, reported: &[pb::Member]) -> Vec<Change> {
    let mut changed: BTreeMap<String, JobRecord> = BTreeMap::new();
    let mut seen = vec![false; reported.len()];
    for j in s.jobs.values() {
        let mut upd: Option<JobRecord> = None;
        for (k, m) in j.members.iter().enumerate() {
            if m.node != node {
                continue;
            }
            let found = reported
                .iter()
                .position(|r| r.job == j.name && m.is(node, r));
            if let Some(i) = found {
                seen[i] = true;
            }
            let alive = found.is_some();
            if m.alive != alive {
                if !alive {
                    tracing::info!(job = %j.name, node, pid = m.pid, "member is gone");
                }
                upd.get_or_insert_with(|| j.clone()).members[k].alive = alive;
            }
        }
        if let Some(u) = upd {
            changed.insert(u.name.clone(), u);
        }
    }
    for (r, _) in reported.iter().zip(&seen).filter(|(_, s)| !**s) {
        if r.job.is_empty() {
            tracing::warn!(node, pid = r.pid, "member without a job name ignored");
            continue;
        }
        let j = changed.entry(r.job.clone()).or_insert_with(|| {
            s.jobs.get(&r.job).cloned().unwrap_or_else(|| {
                tracing::info!(job = %r.job, node, "new job");
                JobRecord::new(&r.job)
            })
        });
        if j.members.iter().any(|m| m.is(node, r)) {
            continue; // reported twice
        }
        // A job none of whose members lives any more starts afresh.
        if !j.members.is_empty() && j.members.iter().all(|m| !m.alive) {
            j.members.clear();
        }
        tracing::info!(job = %r.job, node, pid = r.pid, command = %r.command, "new member");
        j.members.push(MemberRecord::from_member(node, r));
    }
    changed.into_values().map(Change::Job).collect()
}

impl Coordinator {
    /// An agent (re)registers: record its node and members.
    pub fn register(
        self: &Arc<Self>,
        req: pb::RegisterRequest,
    ) -> Result<pb::RegisterReply, Error> {
        if req.node.is_empty() || req.agent_addr.is_empty() {
            return Err(Error::Invalid {
                what: "Register needs a node name and an agent address".into(),
            });
        }
        let now = now_unix_ms();
        let was_up;
        {
            let mut reg = self
                .registry
                .nodes
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            was_up = reg
                .get(&req.node)
                .is_some_and(|l| l.last_seen.elapsed() <= self.settings.node_timeout);
            self.catalog.update(|s| {
                let mut changes = vec![Change::Node(NodeRecord {
                    name: req.node.clone(),
                    agent_addr: req.agent_addr.clone(),
                    addresses: req.addresses.clone(),
                    version: req.version.clone(),
                    registered_unix_ms: now,
                    // A drain outlives the agent's restarts.
                    drained: s.nodes.get(&req.node).is_some_and(|n| n.drained),
                })];
                changes.extend(sync_members(s, &req.node, &req.members));
                Ok::<_, Error>((changes, ()))
            })?;
            reg.insert(
                req.node.clone(),
                Live {
                    last_seen: Instant::now(),
                    last_seen_unix_ms: now,
                    generation: req.generation,
                    down_logged: false,
                },
            );
        }
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
            heartbeat_ms: self.settings.heartbeat_ms,
            drained: self.is_drained(&req.node),
        })
    }

    /// An agent's heartbeat with its current members.
    pub fn heartbeat(
        self: &Arc<Self>,
        req: pb::HeartbeatRequest,
    ) -> Result<pb::HeartbeatReply, Error> {
        let came_back;
        {
            let mut reg = self
                .registry
                .nodes
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let Some(live) = reg.get_mut(&req.node) else {
                tracing::debug!(node = %req.node, "heartbeat from an unregistered node");
                return Ok(pb::HeartbeatReply {
                    register_again: true,
                    drained: false,
                });
            };
            came_back = live.last_seen.elapsed() > self.settings.node_timeout;
            live.last_seen = Instant::now();
            live.last_seen_unix_ms = now_unix_ms();
            live.down_logged = false;
            if req.generation < live.generation {
                tracing::debug!(
                    node = %req.node,
                    generation = req.generation,
                    last = live.generation,
                    "stale member report ignored"
                );
            } else {
                live.generation = req.generation;
                self.catalog
                    .update(|s| Ok::<_, Error>((sync_members(s, &req.node, &req.members), ())))?;
            }
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
        })
    }

    /// Send FINISH again to `node` for the committed checkpoints it has not
    /// acknowledged (in the background).
    pub(crate) fn resend_finish(self: &Arc<Self>, node: &str) {
        let pending: Vec<(String, i32)> = self
            .catalog
            .unfinished()
            .into_iter()
            .filter(|c| {
                c.nodes().iter().any(|n| n == node)
                    && !c.finished_nodes.iter().any(|n| n == node)
                    // FINISH failed there and crctl said so: never again.
                    && !c.info().unfinished.iter().any(|n| n == node)
                    && !self.is_active_checkpoint(c.id())
            })
            .map(|c| (c.id().to_string(), c.info().after))
            .collect();
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
