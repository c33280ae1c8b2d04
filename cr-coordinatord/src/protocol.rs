//! The coordinated checkpoint and restart of a job (docs/CLUSTER.md, "The
//! protocol"), driven through [`AgentApi`](crate::AgentApi) and recorded in the catalog.
//!
//! Checkpoint: PREPARE (parallel) → CHECK (consistent cut, external
//! connections) → DUMP (parallel, cut checked again on the images) →
//! COMMIT (one catalog transaction) → FINISH (parallel; it carries the
//! decision: an agent commits its images on it) → retention. Any failure,
//! timeout or stop before COMMIT aborts every agent that was sent PREPARE
//! and records `aborted` with the reason.
//!
//! Restart: RESTORE (parallel, frozen, addresses of moved nodes rewritten)
//! → RELEASE (parallel) → the job's members are the restored processes →
//! Unlock on the nodes the images moved away from.

use crate::agents::AgentResult;
use crate::catalog::{
    state, Change, CheckpointRecord, JobRecord, MemberRecord, NodeRecord, EXTERNAL_ALLOW,
    SCOPE_MEMBER,
};
use crate::coordinator::{now_unix_ms, Busy, Coordinator, OpKind};
use crate::error::Error;
use crate::fault;
use crate::migrate::{self, Placement};
use crate::precopy::{MemberKey, PreCopy};
use cr_image::bookmarks::{check_cut, unmatched, Bookmark};
use cr_rpc::pb;
use futures_util::future::join_all;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Added to the remaining deadline in the session timeout told to agents,
/// so that they never give up before the coordinator does.
const SESSION_MARGIN: Duration = Duration::from_secs(5);
/// Bound of each best-effort call (Abort, Remove, Unlock) and the
/// least time FINISH and RELEASE get after the deadline.
const BEST_EFFORT: Duration = Duration::from_secs(10);
/// How long a reply waits for the ABORTs it sent.
const ABORT_WAIT: Duration = Duration::from_secs(2);

fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

/// `addr` as matched in the cut: loopback addresses are only meaningful on
/// their node, so they are prefixed with its name.
pub fn scoped_addr(node: &str, addr: &str) -> String {
    let loopback = match addr.parse::<SocketAddr>() {
        Ok(sa) => match sa.ip() {
            std::net::IpAddr::V4(ip) => ip.is_loopback(),
            std::net::IpAddr::V6(ip) => {
                ip.is_loopback() || ip.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
            }
        },
        Err(_) => {
            let a = addr.trim_start_matches('[');
            a.starts_with("127.") || a.starts_with("::1]") || a.starts_with("::ffff:127.")
        }
    };
    if loopback {
        format!("{node}/{addr}")
    } else {
        addr.to_string()
    }
}

/// CHECK: the bookmarks of all members (with their node) are a consistent
/// cut, and connections leading outside the job are allowed by the policy.
/// How many connections were matched, and how many lead outside.
pub fn check_bookmarks(
    job: &str,
    allow_external: bool,
    marks: &[(&str, &pb::Bookmark)],
) -> Result<(u32, u32), String> {
    let mut bms = Vec::with_capacity(marks.len());
    let mut origin: HashMap<(String, String), (&str, &pb::Bookmark)> =
        HashMap::with_capacity(marks.len());
    for (node, b) in marks {
        let bm = Bookmark {
            local: scoped_addr(node, &b.local),
            remote: scoped_addr(node, &b.remote),
            snd_una: b.snd_una,
            snd_nxt: b.snd_nxt,
            rcv_nxt: b.rcv_nxt,
            write_seq: b.write_seq,
        };
        origin.insert((bm.local.clone(), bm.remote.clone()), (node, b));
        bms.push(bm);
    }
    let matched = check_cut(&bms).map_err(|e| format!("inconsistent cut: {e}"))?;
    let outside = unmatched(&bms);
    if let Some(o) = outside.first().filter(|_| !allow_external) {
        let (node, b) = origin[&(o.local.clone(), o.remote.clone())];
        return Err(format!(
            "connection {} -> {} of pid {} on node {node} leads outside the job (set `crctl job {job} --external allow` to accept it)",
            b.local, b.remote, b.pid
        ));
    }
    Ok((matched as u32, outside.len() as u32))
}

/// `fut` with the deadline; the node's name and its result.
pub(crate) async fn timed<T>(
    deadline: Instant,
    what: &str,
    node: &str,
    fut: impl Future<Output = AgentResult<T>>,
) -> (String, AgentResult<T>) {
    bounded(Bound::plain(deadline), what, node, fut).await
}

/// A deadline and what it is, for the message of a call that misses it.
#[derive(Clone, Copy)]
struct Bound {
    at: Instant,
    /// The freeze bound (ms) when that is what `at` is.
    freeze_ms: Option<u64>,
}

impl Bound {
    fn plain(at: Instant) -> Bound {
        Bound {
            at,
            freeze_ms: None,
        }
    }

    /// The earlier of the operation's deadline and the freeze bound.
    fn frozen(deadline: Instant, freeze_at: Instant, freeze_ms: u64) -> Bound {
        if freeze_at < deadline {
            Bound {
                at: freeze_at,
                freeze_ms: Some(freeze_ms),
            }
        } else {
            Bound::plain(deadline)
        }
    }
}

async fn bounded<T>(
    b: Bound,
    what: &str,
    node: &str,
    fut: impl Future<Output = AgentResult<T>>,
) -> (String, AgentResult<T>) {
    let r = match tokio::time::timeout_at(b.at.into(), fut).await {
        Ok(r) => r.map_err(|e| format!("{what}: {e}")),
        Err(_) => Err(match b.freeze_ms {
            Some(ms) => format!("no reply to {what} within the freeze bound ({ms} ms)"),
            None => format!("no reply to {what} within the deadline"),
        }),
    };
    (node.to_string(), r)
}

/// The freeze bound when none is asked for: the configured one, or more
/// for a job whose last checkpoint took long (twice its PREPARE, CHECK
/// and DUMP, plus 5 s): a few seconds beyond the expected dump time.
pub fn default_freeze_bound(configured: Duration, last: Option<&pb::CheckpointInfo>) -> Duration {
    let expected = last.map_or(0, |c| c.prepare_ms + c.check_ms + c.dump_ms);
    configured.max(Duration::from_millis(expected * 2 + 5000).min(Duration::from_secs(3600)))
}

/// All the replies, or the first failure as "node N: ...".
fn all_ok<T>(results: Vec<(String, AgentResult<T>)>) -> Result<Vec<(String, T)>, String> {
    results
        .into_iter()
        .map(|(n, r)| {
            r.map(|v| (n.clone(), v))
                .map_err(|e| format!("node {n}: {e}"))
        })
        .collect()
}

/// `items` grouped by node, nodes in order of first appearance.
pub(crate) fn group_by_node<T>(
    items: impl IntoIterator<Item = (String, T)>,
) -> Vec<(String, Vec<T>)> {
    let mut out: Vec<(String, Vec<T>)> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    for (node, t) in items {
        match index.get(&node) {
            Some(&k) => out[k].1.push(t),
            None => {
                index.insert(node.clone(), out.len());
                out.push((node, vec![t]));
            }
        }
    }
    out
}

/// The placement and per-node targets of a checkpoint.
struct Hosts {
    /// Node → its targets, in order of first appearance.
    nodes: Vec<(String, Vec<pb::Target>)>,
}

impl Hosts {
    fn names(&self) -> Vec<String> {
        self.nodes.iter().map(|(n, _)| n.clone()).collect()
    }
}

/// How a checkpoint runs (besides its job and what follows it).
#[derive(Debug, Clone, Default)]
pub struct CheckpointOpts {
    /// Bound of the whole protocol; `None`: the coordinator's timeout.
    pub timeout: Option<Duration>,
    /// Freeze bound; `None`: the job's, else [`default_freeze_bound`].
    pub freeze: Option<Duration>,
    /// Pre-copy rounds first ([`crate::precopy`]; `None`: as the job's
    /// setting says), the members named here fetched after each round by
    /// the node named (a migration's targets).
    pub pre_copy: Option<HashMap<MemberKey, String>>,
    /// Retention is left to the caller (a migration runs it once the job
    /// runs again, not during its downtime).
    pub defer_retention: bool,
    /// Only this member (node, pid): its own checkpoint, scope `member`
    /// ([`Coordinator::checkpoint_member`]).
    pub only: Option<(String, i32)>,
    /// Each member frozen only for its own dump, its connections held
    /// until every member is dumped (also when the job's mode says so).
    pub non_blocking: bool,
    /// Limits for members linked with libcr (None: the agents' defaults).
    pub coop: Option<pb::Cooperation>,
    /// With KILL: members (node, pid) whose exit FINISH does not wait for
    /// (a migration's moved members: restored elsewhere, see
    /// FinishRequest.exit_later).
    pub exit_later: Vec<MemberKey>,
}

/// How a restart runs (besides where: [`Placement`]).
#[derive(Debug, Clone, Default)]
pub struct RestartOpts {
    /// Bound of the whole restart; `None`: the coordinator's timeout.
    pub timeout: Option<Duration>,
    /// Restore although files outside the images changed since the
    /// checkpoint (`cr_restart --allow-changed-files`).
    pub allow_changed_files: bool,
    /// Restart each member from its checkpoint on the job's recovery line
    /// ([`crate::recovery`]) instead of from one checkpoint.
    pub line: bool,
    /// The trees run before their private anonymous pages are in (see
    /// `pb::RestoreRequest::lazy_pages`).
    pub lazy_pages: bool,
}

impl Coordinator {
    /// Run `fut` unless the coordinator stops first.
    async fn unless_stopped<T>(&self, fut: impl Future<Output = T>) -> Result<T, String> {
        tokio::select! {
            r = fut => Ok(r),
            _ = self.stopped() => Err("the coordinator is stopping".into()),
        }
    }

    /// ABORT to every node at once; the reply waits at most [`ABORT_WAIT`]
    /// for them (an unreachable node's call goes on in the background, and
    /// that node lets go on its own anyway).
    async fn abort_all(&self, session: &str, nodes: &[String]) {
        let agents = self.agents.clone();
        let session = session.to_string();
        let nodes = nodes.to_vec();
        let all =
            tokio::spawn(async move {
                let deadline = Instant::now() + BEST_EFFORT;
                let res =
                    join_all(nodes.iter().map(|n| {
                        let req = pb::SessionRequest {
                            session: session.clone(),
                        };
                        let a = agents.clone();
                        let n = n.clone();
                        async move {
                            timed(deadline, "ABORT", &n, async { a.abort(&n, req).await }).await
                        }
                    }))
                    .await;
                for (n, r) in res {
                    if let Err(e) = r {
                        tracing::warn!(id = %session, node = %n, "{e}");
                    }
                }
            });
        let _ = tokio::time::timeout(ABORT_WAIT, all).await;
    }

    /// A coordinated checkpoint of `job` (see the module doc). `timeout`:
    /// the whole protocol's deadline (default: the configured one).
    pub async fn checkpoint(
        &self,
        job: &str,
        after: pb::After,
        timeout: Option<Duration>,
    ) -> Result<pb::CheckpointInfo, Error> {
        self.checkpoint_with(job, after, timeout, None, false).await
    }

    /// [`Coordinator::checkpoint`] with a freeze bound (default: the
    /// job's, else [`default_freeze_bound`]): past it, the checkpoint is
    /// aborted and every node thaws at once; with `pre_copy` (or the job's
    /// setting), memory is pre-copied first ([`crate::precopy`]).
    pub async fn checkpoint_with(
        &self,
        job: &str,
        after: pb::After,
        timeout: Option<Duration>,
        freeze: Option<Duration>,
        pre_copy: bool,
    ) -> Result<pb::CheckpointInfo, Error> {
        let opts = CheckpointOpts {
            timeout,
            freeze,
            pre_copy: pre_copy.then(HashMap::new),
            ..Default::default()
        };
        self.checkpoint_on(job, after, &opts).await
    }

    /// One member's own checkpoint (uncoordinated mode, see
    /// [`crate::recovery`]): member `pid` on `node` is frozen, dumped and
    /// let go alone while the others run on; its connections to them are
    /// not judged (the recovery line does that).
    pub async fn checkpoint_member(
        &self,
        job: &str,
        node: &str,
        pid: i32,
    ) -> Result<pb::CheckpointInfo, Error> {
        let opts = CheckpointOpts {
            only: Some((node.to_string(), pid)),
            ..Default::default()
        };
        self.checkpoint_on(job, pb::After::Continue, &opts).await
    }

    /// [`Coordinator::checkpoint_with`] with every option.
    pub async fn checkpoint_on(
        &self,
        job: &str,
        after: pb::After,
        opts: &CheckpointOpts,
    ) -> Result<pb::CheckpointInfo, Error> {
        let (timeout, freeze) = (opts.timeout, opts.freeze);
        let only = opts.only.as_ref().map(|(n, p)| (n.as_str(), *p));
        let t0 = Instant::now();
        let deadline = t0 + timeout.unwrap_or(self.settings.timeout);
        let busy = self.begin(job, OpKind::Checkpoint, format!("checkpoint of {job}"))?;
        let live = self.liveness();
        let (jobrec, prev) = self.catalog.read(|s| {
            let prev = match only {
                // A member's own checkpoint is incremental on its latest
                // image, of whichever scope.
                Some((node, pid)) => s
                    .job_checkpoints(job)
                    .rev()
                    .filter(|c| c.state() == state::COMMITTED)
                    .find_map(|c| {
                        let i = c
                            .info()
                            .images
                            .iter()
                            .find(|i| i.node == node && i.pid == pid)?;
                        Some(pb::CheckpointInfo {
                            images: vec![i.clone()],
                            ..c.info().clone()
                        })
                    }),
                None => s.latest_committed(job).map(|c| c.info().clone()),
            };
            (s.jobs.get(job).cloned(), prev)
        });
        let mut jobrec = jobrec.ok_or_else(|| Error::UnknownJob { job: job.into() })?;
        let non_blocking = only.is_none() && (opts.non_blocking || jobrec.non_blocking());
        if non_blocking && after != pb::After::Continue {
            return Err(Error::Invalid {
                what: format!(
                    "a non-blocking checkpoint lets each member run on after its dump: it cannot {}",
                    after.as_str_name().to_lowercase()
                ),
            });
        }
        let scope = match only {
            Some((node, pid)) => {
                if !jobrec
                    .members
                    .iter()
                    .any(|m| m.node == node && m.pid == pid)
                {
                    return Err(Error::Invalid {
                        what: format!("job {job} has no member {node}:{pid}"),
                    });
                }
                jobrec.members.retain(|m| m.node == node && m.pid == pid);
                // Its connections to the other members lead outside this
                // checkpoint: the recovery line judges them.
                jobrec.external = EXTERNAL_ALLOW.into();
                jobrec.pre_copy = false;
                SCOPE_MEMBER
            }
            None => "",
        };
        let freeze = freeze
            .or((jobrec.freeze_timeout_ms > 0)
                .then(|| Duration::from_millis(jobrec.freeze_timeout_ms)))
            .unwrap_or_else(|| default_freeze_bound(self.settings.freeze_timeout, prev.as_ref()));
        // Members that are gone cannot be part of it: dropped from the job.
        let mut notes = Vec::new();
        let dead: Vec<(String, i32)> = jobrec
            .members
            .iter()
            .filter(|m| !m.alive)
            .map(|m| (m.node.clone(), m.pid))
            .collect();
        if !dead.is_empty() {
            for (n, p) in &dead {
                notes.push(format!(
                    "member {p} on {n} had exited: dropped from the job"
                ));
            }
            self.drop_members(job, &dead)?;
            jobrec.members.retain(|m| m.alive);
        }
        // Incremental: each member's image in the previous checkpoint.
        let prev_dirs: HashMap<(&str, i32), &str> = prev
            .iter()
            .filter(|_| jobrec.incremental)
            .flat_map(|p| &p.images)
            .map(|i| ((i.node.as_str(), i.pid), i.dir.as_str()))
            .collect();
        let mut targets = Vec::new();
        for m in jobrec.members.iter().filter(|m| m.alive) {
            if !live.is_up(&m.node) {
                return Err(Error::NodeDown {
                    job: job.into(),
                    node: m.node.clone(),
                    why: live.down_reason(&m.node),
                });
            }
            let parent = prev_dirs
                .get(&(m.node.as_str(), m.pid))
                .map(|d| d.to_string())
                .unwrap_or_default();
            targets.push((m.node.clone(), pb::Target { pid: m.pid, parent }));
        }
        // Pre-copy: every member pre-dumped while the job runs; each is
        // then dumped incrementally on its last pre-dump.
        let mut pre = PreCopy::default();
        if let Some(fetch_to) = opts
            .pre_copy
            .clone()
            .or_else(|| jobrec.pre_copy.then(HashMap::new))
        {
            let members: Vec<MemberKey> = targets.iter().map(|(n, t)| (n.clone(), t.pid)).collect();
            let firsts: HashMap<MemberKey, String> = targets
                .iter()
                .filter(|(_, t)| !t.parent.is_empty())
                .map(|(n, t)| ((n.clone(), t.pid), t.parent.clone()))
                .collect();
            pre = self
                .unless_stopped(self.pre_copy(&busy, job, &members, &firsts, &fetch_to, deadline))
                .await
                .and_then(|r| r)
                .map_err(|reason| Error::PreCopyFailed {
                    job: job.into(),
                    reason,
                })?;
            for (n, t) in targets.iter_mut() {
                if let Some(d) = pre.parents.get(&(n.clone(), t.pid)) {
                    t.parent = d.clone();
                }
            }
        }
        // The freeze and what follows have the whole timeout.
        let t0 = Instant::now();
        let deadline = t0 + timeout.unwrap_or(self.settings.timeout);
        let hosts = Hosts {
            nodes: group_by_node(targets),
        };
        if hosts.nodes.is_empty() {
            return Err(Error::NoLiveMember { job: job.into() });
        }

        // Its id, recorded as preparing.
        let started = now_unix_ms();
        let rec = self.catalog.update(|s| {
            let n = s.sequence(job) + 1;
            let rec = CheckpointRecord {
                info: Some(pb::CheckpointInfo {
                    id: format!("{job}-{n}"),
                    job: job.to_string(),
                    state: state::PREPARING.into(),
                    after: after as i32,
                    started_unix_ms: started,
                    notes: notes.clone(),
                    freeze_timeout_ms: ms(freeze),
                    pre_copy_rounds: pre.rounds,
                    pre_copy_bytes: pre.written,
                    pre_copy_ms: pre.ms,
                    pre_copy_fetched: pre.fetched,
                    scope: scope.into(),
                    non_blocking,
                    ..Default::default()
                }),
                seq: n,
                ..Default::default()
            };
            Ok::<_, Error>((
                vec![
                    Change::Sequence(job.to_string(), n),
                    Change::Checkpoint(rec.clone()),
                ],
                rec,
            ))
        });
        let mut rec = match rec {
            Ok(r) => r,
            Err(e) => {
                self.remove_pre_dumps(job, &pre).await;
                return Err(e);
            }
        };
        let id = rec.id().to_string();
        busy.set(&id, &format!("checkpoint {id}"), "preparing");
        tracing::info!(
            job,
            checkpoint = %id,
            nodes = hosts.nodes.len(),
            members = hosts.nodes.iter().map(|(_, t)| t.len()).sum::<usize>(),
            after = after.as_str_name(),
            "checkpoint started"
        );

        if let Err(reason) = self
            .run_checkpoint(
                &busy,
                &mut rec,
                &jobrec,
                &hosts,
                (deadline, freeze, t0),
                opts.coop.as_ref(),
            )
            .await
        {
            // The decision first, so that it stands whatever happens next.
            let info = rec.info_mut();
            info.state = state::ABORTED.into();
            info.error = reason.clone();
            info.duration_ms = ms(t0.elapsed());
            if let Err(e) = self
                .catalog
                .update(|_| Ok::<_, Error>((vec![Change::Checkpoint(rec.clone())], ())))
            {
                tracing::error!(job, checkpoint = %id, "cannot record the abort: {e}");
            }
            self.abort_all(&id, &hosts.names()).await;
            self.remove_pre_dumps(job, &pre).await;
            tracing::warn!(job, checkpoint = %id, ms = ms(t0.elapsed()), "checkpoint aborted: {reason}");
            busy.end("aborted", format!("checkpoint {id}: aborted: {reason}"));
            return Err(Error::Aborted {
                job: job.into(),
                id,
                reason,
            });
        }

        self.finish_checkpoint(
            &busy,
            &mut rec,
            &hosts,
            (after, &opts.exit_later),
            deadline,
            t0,
        )
        .await;
        self.replicate(&busy, &mut rec, jobrec.replicas).await;
        if !opts.defer_retention {
            busy.phase("removing old checkpoints");
            self.retain(job).await;
        }
        let i = rec.info();
        busy.end(
            "committed",
            format!(
                "checkpoint {id}: committed, paused {} ms, {} written",
                i.pause_ms,
                crate::events::bytes(i.images.iter().map(|m| m.store_bytes).sum())
            ),
        );
        Ok(rec.info().clone())
    }

    /// CALLBACKS (PREPARE with callbacks_first), FREEZE, CHECK, DUMP,
    /// COMMIT; the reason of a failure before the commit is recorded. The
    /// members stay frozen at most `freeze` from FREEZE: every call from
    /// there to the commit is bounded by it. `times`: the protocol's
    /// deadline, the freeze bound and its start.
    async fn run_checkpoint(
        &self,
        busy: &Busy<'_>,
        rec: &mut CheckpointRecord,
        jobrec: &JobRecord,
        hosts: &Hosts,
        times: (Instant, Duration, Instant),
        coop: Option<&pb::Cooperation>,
    ) -> Result<(), String> {
        let (deadline, freeze, t0) = times;
        let id = rec.id().to_string();
        let job = jobrec.name.as_str();
        let allow = jobrec.external == EXTERNAL_ALLOW;
        let after = rec.info().after;

        // PREPARE: every member's libcr callbacks, on every node, before
        // any member is frozen (a callback may need its peers running).
        let t = Instant::now();
        let timeout_ms = ms(deadline.saturating_duration_since(t) + SESSION_MARGIN) as u32;
        let calls = hosts.nodes.iter().map(|(node, targets)| {
            let req = pb::PrepareRequest {
                session: id.clone(),
                job: job.to_string(),
                targets: targets.clone(),
                after,
                subdir: format!("{job}/{id}"),
                timeout_ms,
                freeze_timeout_ms: ms(freeze).min(u64::from(u32::MAX)) as u32,
                non_blocking: rec.info().non_blocking,
                save_files: jobrec.save_files,
                callbacks_first: true,
                coop: coop.copied(),
            };
            bounded(
                Bound::plain(deadline),
                "PREPARE",
                node,
                self.agents.prepare(node, req),
            )
        });
        let called = all_ok(self.unless_stopped(join_all(calls)).await?)?;
        let cooperating: u32 = called.iter().map(|(_, r)| r.cooperating).sum();
        rec.info_mut().callbacks_ms = ms(t.elapsed());
        tracing::info!(
            job,
            checkpoint = %id,
            phase = "callbacks",
            ms = ms(t.elapsed()),
            cooperating,
            "phase done"
        );

        // FREEZE
        let bound = Bound::frozen(deadline, Instant::now() + freeze, ms(freeze));
        let calls = hosts.nodes.iter().map(|(node, _)| {
            let req = pb::SessionRequest {
                session: id.clone(),
            };
            bounded(bound, "FREEZE", node, self.agents.freeze(node, req))
        });
        let prepared = all_ok(self.unless_stopped(join_all(calls)).await?)?;
        fault::point("prepare").await;
        // Members that had exited: dropped from the checkpoint and the job.
        let mut gone: Vec<(String, i32)> = Vec::new();
        for (node, r) in &prepared {
            gone.extend(r.gone.iter().map(|&p| (node.clone(), p)));
        }
        rec.info_mut().prepare_ms = ms(t.elapsed());
        tracing::info!(job, checkpoint = %id, phase = "prepare", ms = ms(t.elapsed()), "phase done");

        // CHECK
        busy.phase("checking");
        let t = Instant::now();
        let marks: Vec<(&str, &pb::Bookmark)> = prepared
            .iter()
            .flat_map(|(n, r)| r.bookmarks.iter().map(move |b| (n.as_str(), b)))
            .collect();
        // With members gone, their peers' connections lead nowhere: they
        // are counted as external (and noted), not a reason to abort.
        let (conns, external) = check_bookmarks(job, allow || !gone.is_empty(), &marks)?;
        rec.info_mut().check_ms = ms(t.elapsed());
        if prepared.iter().all(|(_, r)| r.processes == 0) {
            return Err("every member had exited: nothing to checkpoint".into());
        }
        tracing::info!(
            job,
            checkpoint = %id,
            phase = "check",
            ms = ms(t.elapsed()),
            connections = conns,
            external,
            "phase done"
        );

        // DUMP
        busy.phase("dumping");
        rec.info_mut().state = state::DUMPING.into();
        self.catalog
            .update(|_| Ok::<_, Error>((vec![Change::Checkpoint(rec.clone())], ())))
            .map_err(|e| format!("cannot record the dump: {e}"))?;
        let t = Instant::now();
        let calls = hosts.nodes.iter().map(|(node, _)| {
            let req = pb::SessionRequest {
                session: id.clone(),
            };
            bounded(bound, "DUMP", node, self.agents.dump(node, req))
        });
        let dumped = all_ok(self.unless_stopped(join_all(calls)).await?)?;
        fault::point("dump").await;
        for (node, r) in &dumped {
            gone.extend(r.gone.iter().map(|&p| (node.clone(), p)));
        }
        let mut images = Vec::new();
        for ((node, reply), (_, targets)) in dumped.into_iter().zip(&hosts.nodes) {
            for t in targets {
                if gone.iter().any(|(n, p)| *n == node && *p == t.pid) {
                    continue;
                }
                if !reply.images.iter().any(|i| i.pid == t.pid) {
                    return Err(format!(
                        "node {node}: DUMP returned no image of pid {}",
                        t.pid
                    ));
                }
            }
            images.extend(reply.images.into_iter().map(|mut i| {
                i.node = node.clone();
                i
            }));
        }
        let marks: Vec<(&str, &pb::Bookmark)> = images
            .iter()
            .flat_map(|i| i.bookmarks.iter().map(move |b| (i.node.as_str(), b)))
            .collect();
        if images.is_empty() {
            return Err("every member exited during the checkpoint: nothing to commit".into());
        }
        let (conns, external) = check_bookmarks(job, allow || !gone.is_empty(), &marks)
            .map_err(|e| format!("in the images: {e}"))?;
        if !gone.is_empty() {
            for (n, p) in &gone {
                rec.info_mut().notes.push(format!(
                    "member {p} on {n} exited during the checkpoint: dropped from it and from the job"
                ));
            }
            self.drop_members(job, &gone)
                .map_err(|e| format!("cannot record the members that exited: {e}"))?;
        }
        rec.info_mut().dump_ms = ms(t.elapsed());
        tracing::info!(
            job,
            checkpoint = %id,
            phase = "dump",
            ms = ms(t.elapsed()),
            images = images.len(),
            bytes = images.iter().map(|i| i.store_bytes).sum::<u64>(),
            "phase done"
        );
        if self.is_stopping() {
            return Err("the coordinator is stopping".into());
        }
        if Instant::now() >= bound.at {
            return Err(match bound.freeze_ms {
                Some(ms) => format!(
                    "the members were frozen for the freeze bound ({ms} ms) before the commit"
                ),
                None => "the deadline passed before the commit".into(),
            });
        }

        // COMMIT
        busy.phase("committing");
        let t = Instant::now();
        let info = rec.info_mut();
        info.state = state::COMMITTED.into();
        info.pause_ms = images.iter().map(|i| i.frozen_ms).max().unwrap_or(0);
        info.images = images;
        info.connections = conns;
        info.external = external;
        info.duration_ms = ms(t0.elapsed());
        self.catalog
            .update(|_| Ok::<_, Error>((vec![Change::Checkpoint(rec.clone())], ())))
            .map_err(|e| {
                // Not recorded: it is not committed, abort it.
                rec.info_mut().state = state::DUMPING.into();
                format!("cannot record the commit: {e}")
            })?;
        rec.info_mut().commit_ms = ms(t.elapsed());
        tracing::info!(job, checkpoint = %id, phase = "commit", ms = ms(t.elapsed()), "checkpoint committed");
        fault::point("commit").await;
        Ok(())
    }

    /// After the commit: FINISH to every agent; record who acknowledged
    /// (and, for KILL, that the members are gone). FINISH is the commit's
    /// message too: an agent keeps its images as committed on it (no round
    /// of its own, which cost a fan-out to every agent while the members
    /// were still held).
    async fn finish_checkpoint(
        &self,
        busy: &Busy<'_>,
        rec: &mut CheckpointRecord,
        hosts: &Hosts,
        (after, exit_later): (pb::After, &[MemberKey]),
        deadline: Instant,
        t0: Instant,
    ) {
        let id = rec.id().to_string();
        let job = rec.info().job.clone();
        let nodes = hosts.names();
        busy.phase("finishing");
        fault::point("finish").await;

        let t = Instant::now();
        let finish_deadline = deadline.max(t + BEST_EFFORT);
        let calls = nodes.iter().map(|n| {
            let req = pb::FinishRequest {
                session: id.clone(),
                after: after as i32,
                exit_later: exit_later
                    .iter()
                    .filter(|(m, _)| m == n)
                    .map(|(_, p)| *p)
                    .collect(),
            };
            timed(finish_deadline, "FINISH", n, self.agents.finish(n, req))
        });
        let mut acked = Vec::new();
        let (mut paused, mut held) = (0, 0);
        // Each node's images, not a scan of every image per reply.
        let mut by_node: HashMap<String, Vec<usize>> = HashMap::new();
        for (k, img) in rec.info().images.iter().enumerate() {
            by_node.entry(img.node.clone()).or_default().push(k);
        }
        for (n, r) in join_all(calls).await {
            match r {
                Ok(reply) => {
                    paused = paused.max(reply.frozen_ms);
                    held = held.max(reply.held_ms);
                    // The real freeze of each member: until it was let go.
                    let images = &mut rec.info_mut().images;
                    for &k in by_node.get(&n).map_or(&[][..], Vec::as_slice) {
                        let img = &mut images[k];
                        if let Some(&f) = reply.member_frozen_ms.get(&img.pid) {
                            img.frozen_ms = img.frozen_ms.max(f);
                        }
                    }
                    acked.push(n)
                }
                Err(e) => {
                    tracing::warn!(job = %job, checkpoint = %id, node = %n, "{e}");
                    // The agent lets its processes run on when FINISH does
                    // not come (or failed): the request was not carried out
                    // there, and it never will be (no FINISH is sent again).
                    let what = match after {
                        pb::After::Continue => "its members run on",
                        _ => "its members are still running",
                    };
                    rec.info_mut()
                        .notes
                        .push(format!("{n} could not finish: {what} ({e})"));
                    rec.info_mut().unfinished.push(n.clone());
                }
            }
        }
        tracing::info!(job = %job, checkpoint = %id, phase = "finish", ms = ms(t.elapsed()), after = after.as_str_name(), "phase done");
        // Nothing more to send: every node acknowledged or gave up.
        rec.finished = acked.len() + rec.info().unfinished.len() >= nodes.len();
        rec.finished_nodes = acked.clone();
        if paused > 0 {
            rec.info_mut().pause_ms = paused;
        }
        rec.info_mut().held_ms = held;
        rec.info_mut().duration_ms = ms(t0.elapsed());
        let res = self.catalog.update(|s| {
            let mut changes = vec![Change::Checkpoint(rec.clone())];
            if after == pb::After::Kill {
                let acked: HashSet<&str> = acked.iter().map(String::as_str).collect();
                let killed: HashSet<(&str, i32)> = hosts
                    .nodes
                    .iter()
                    .filter(|(n, _)| acked.contains(n.as_str()))
                    .flat_map(|(n, ts)| ts.iter().map(move |t| (n.as_str(), t.pid)))
                    .collect();
                if let Some(j) = s.jobs.get(&job) {
                    let mut j = j.clone();
                    let mut changed = false;
                    for m in j.members.iter_mut().filter(|m| m.alive) {
                        if killed.contains(&(m.node.as_str(), m.pid)) {
                            m.alive = false;
                            changed = true;
                        }
                    }
                    if changed {
                        changes.push(Change::Job(j));
                    }
                }
            }
            Ok::<_, Error>((changes, ()))
        });
        if let Err(e) = res {
            tracing::error!(job = %job, checkpoint = %id, "cannot record FINISH: {e}");
        }
        let i = rec.info();
        tracing::info!(
            job = %job,
            checkpoint = %id,
            ms = i.duration_ms,
            pause_ms = i.pause_ms,
            prepare_ms = i.prepare_ms,
            check_ms = i.check_ms,
            dump_ms = i.dump_ms,
            commit_ms = i.commit_ms,
            "checkpoint done"
        );
    }

    /// Retention: remove the committed checkpoints of `job` beyond its
    /// newest `keep`, or behind its recovery line when it is uncoordinated
    /// (each image by the node that wrote it, or by any node
    /// up when that one is down: the image root is shared).
    pub(crate) async fn retain(&self, job: &str) {
        let behind_line = self
            .catalog
            .read(|s| s.jobs.get(job).is_some_and(JobRecord::uncoordinated));
        let victims: Vec<CheckpointRecord> = self.catalog.read(|s| {
            // Uncoordinated: what lies wholly behind the recovery line.
            if behind_line {
                let Ok(h) = crate::recovery::History::of(s, job) else {
                    return Vec::new();
                };
                let line = h.line();
                return h.garbage(&line).into_iter().cloned().collect();
            }
            let keep = s.jobs.get(job).map_or(0, |j| j.keep) as usize;
            if keep == 0 {
                return Vec::new();
            }
            let committed: Vec<&CheckpointRecord> = s
                .job_checkpoints(job)
                .filter(|c| c.state() == state::COMMITTED)
                .collect();
            let n = committed.len().saturating_sub(keep);
            committed[..n].iter().map(|c| (*c).clone()).collect()
        });
        if victims.is_empty() {
            return;
        }
        let live = self.liveness();
        let any_up = self
            .catalog
            .read(|s| s.nodes.keys().find(|n| live.is_up(n)).cloned());
        let mut removed = Vec::new();
        for mut c in victims {
            let mut placed = Vec::new();
            let mut nowhere = false;
            for i in &c.info().images {
                let Some(node) = Some(&i.node).filter(|n| live.is_up(n)).or(any_up.as_ref()) else {
                    nowhere = true;
                    break;
                };
                placed.push((node.clone(), i.dir.clone()));
                // Copies fetched to other nodes go too (a node down keeps
                // its copy: it is swept from the catalog all the same).
                for r in &i.replicas {
                    if let Some((n, d)) = r.split_once('=').filter(|(n, _)| live.is_up(n)) {
                        placed.push((n.to_string(), d.to_string()));
                    }
                }
            }
            let by_node = group_by_node(placed);
            if nowhere {
                tracing::warn!(job, checkpoint = %c.id(), "retention: no node is up to remove its images");
                continue;
            }
            let deadline = Instant::now() + BEST_EFFORT;
            let calls = by_node.iter().map(|(n, dirs)| {
                let req = pb::RemoveRequest { dirs: dirs.clone() };
                timed(deadline, "REMOVE", n, self.agents.remove(n, req))
            });
            match all_ok(join_all(calls).await) {
                Ok(_) => {
                    tracing::info!(job, checkpoint = %c.id(), "retention: removed");
                    c.info_mut().state = state::REMOVED.into();
                    if behind_line {
                        c.info_mut()
                            .notes
                            .push("garbage: behind the recovery line".into());
                    }
                    removed.push(Change::Checkpoint(c));
                }
                Err(e) => {
                    tracing::warn!(job, checkpoint = %c.id(), "retention: {e}; tried again after the next checkpoint")
                }
            }
        }
        if let Err(e) = self.catalog.update(|_| Ok::<_, Error>((removed, ()))) {
            tracing::error!(job, "retention: cannot record the removal: {e}");
        }
    }

    /// Restart `job` from `checkpoint` (default: its latest committed one)
    /// on the nodes `on` (see RestartRequest; empty: the same nodes).
    pub async fn restart(
        &self,
        job: &str,
        checkpoint: Option<&str>,
        on: &[String],
        timeout: Option<Duration>,
    ) -> Result<pb::RestartReply, Error> {
        let opts = RestartOpts {
            timeout,
            ..Default::default()
        };
        self.restart_placed(job, checkpoint, &Placement::Nodes(on.to_vec()), &opts)
            .await
    }

    /// [`Coordinator::restart`] with any [`Placement`]; images restored on
    /// a node that lacks them are fetched there first.
    pub async fn restart_placed(
        &self,
        job: &str,
        checkpoint: Option<&str>,
        placement: &Placement,
        opts: &RestartOpts,
    ) -> Result<pb::RestartReply, Error> {
        let t0 = Instant::now();
        let started_unix_ms = now_unix_ms();
        let deadline = t0 + opts.timeout.unwrap_or(self.settings.timeout);
        let busy = self.begin(job, OpKind::Restart, format!("restart of {job}"))?;
        let live = self.liveness();
        let (jobrec, ck, node_recs) = self.catalog.read(|s| {
            let ck = match checkpoint {
                _ if opts.line => crate::recovery::History::of(s, job)
                    .and_then(|h| h.line_checkpoint(&h.line()))
                    .map(Some),
                Some(id) => Ok(s.checkpoint(id).cloned()),
                None => Ok(s.latest_committed(job).cloned()),
            };
            (s.jobs.get(job).cloned(), ck, s.nodes.clone())
        });
        let ck = ck?;
        let jobrec = jobrec.ok_or_else(|| Error::UnknownJob { job: job.into() })?;
        let running = jobrec
            .members
            .iter()
            .filter(|m| m.alive && live.is_up(&m.node))
            .count();
        if running > 0 {
            return Err(Error::StillRunning {
                job: job.into(),
                count: running,
            });
        }
        let ck = match (ck, checkpoint) {
            (Some(c), _) => c,
            (None, Some(id)) => return Err(Error::UnknownCheckpoint { id: id.into() }),
            (None, None) => return Err(Error::NoCheckpoint { job: job.into() }),
        };
        let id = ck.id().to_string();
        if ck.info().job != job {
            return Err(Error::OtherJob {
                id,
                job: job.into(),
            });
        }
        if ck.state() != state::COMMITTED {
            return Err(Error::NotCommitted {
                id,
                state: ck.state().into(),
            });
        }

        // Placement and address map.
        let auto;
        let placement = match placement {
            Placement::Auto => {
                auto = self.auto_placement(job, ck.info(), &node_recs, &live)?;
                &auto
            }
            p => p,
        };
        let plan = migrate::plan(job, ck.info(), &node_recs, placement).map_err(|what| {
            Error::Invalid {
                what: format!("job {job} from {id}: {what}"),
            }
        })?;
        let images = &ck.info().images;
        for (img, dst) in images.iter().zip(&plan.dst) {
            if !node_recs.contains_key(dst) {
                let mut known: Vec<&str> = node_recs.keys().map(String::as_str).take(10).collect();
                if node_recs.len() > known.len() {
                    known.push("...");
                }
                return Err(Error::UnknownNode {
                    node: dst.clone(),
                    known: known.join(", "),
                });
            }
            if !live.is_up(dst) {
                return Err(Error::NodeDown {
                    job: job.into(),
                    node: dst.clone(),
                    why: live.down_reason(dst),
                });
            }
            // A drained node takes back only its own images.
            if *dst != img.node && node_recs[dst].drained {
                return Err(Error::Drained { node: dst.clone() });
            }
        }
        let map_addr = plan.map_addr.clone();

        let session = self.catalog.update(|s| {
            let mut j = s
                .jobs
                .get(job)
                .cloned()
                .ok_or_else(|| Error::UnknownJob { job: job.into() })?;
            j.restarts += 1;
            let session = format!("{job}-restart-{}", j.restarts);
            j.restarting = session.clone();
            Ok::<_, Error>((vec![Change::Job(j)], session))
        })?;
        busy.set(&id, &format!("restart of {job} from {id}"), "restarting");
        tracing::info!(job, checkpoint = %id, session = %session, on = ?plan.dst, map_addr = ?map_addr, "restart started");
        let fail = |reason: String| Error::RestartFailed {
            job: job.into(),
            id: id.clone(),
            reason,
        };
        let clear_restarting = || {
            let _ = self.catalog.update(|s| {
                let mut changes = vec![];
                if let Some(j) = s.jobs.get(job) {
                    let mut j = j.clone();
                    j.restarting.clear();
                    changes.push(Change::Job(j));
                }
                Ok::<_, Error>((changes, ()))
            });
        };

        // FETCH: images restored on a node that lacks them.
        let t = Instant::now();
        let fetched = match self
            .unless_stopped(self.fetch_images(
                &busy,
                job,
                &ck,
                &plan,
                &live,
                Copying {
                    deadline,
                    lazy: opts.lazy_pages,
                },
            ))
            .await
            .and_then(|r| r)
        {
            Ok(f) => f,
            Err(reason) => {
                clear_restarting();
                tracing::warn!(job, checkpoint = %id, "restart failed: {reason}");
                busy.end(
                    "failed",
                    format!("restart of {job} from {id}: failed: {reason}"),
                );
                return Err(fail(reason));
            }
        };
        let fetch_ms = if fetched.bytes > 0 || !fetched.dirs.is_empty() {
            tracing::info!(job, checkpoint = %id, phase = "fetch", ms = ms(t.elapsed()), bytes = fetched.bytes, "phase done");
            ms(t.elapsed())
        } else {
            0
        };
        if fetched.bytes > 0 {
            self.events.copied(job, fetched.bytes, fetch_ms);
        }
        // Per target node, the indexes of its images.
        let order = group_by_node((0..images.len()).map(|k| (plan.dst[k].clone(), k)));
        let targets: Vec<(String, Vec<pb::RestoreTarget>)> = order
            .iter()
            .map(|(n, ks)| {
                let ts = ks
                    .iter()
                    .map(|&k| pb::RestoreTarget {
                        dir: fetched
                            .dirs
                            .get(&k)
                            .cloned()
                            .unwrap_or_else(|| images[k].dir.clone()),
                        old_pid: images[k].pid,
                        map_addr: plan.own_map[k].clone(),
                    })
                    .collect();
                (n.clone(), ts)
            })
            .collect();
        let dsts: Vec<String> = targets.iter().map(|(n, _)| n.clone()).collect();
        busy.phase("restoring");

        // RESTORE
        let t = Instant::now();
        let timeout_ms = ms(deadline.saturating_duration_since(t) + SESSION_MARGIN) as u32;
        let calls = targets.iter().map(|(node, ts)| {
            let req = pb::RestoreRequest {
                session: session.clone(),
                job: job.to_string(),
                targets: ts.clone(),
                map_addr: map_addr.clone(),
                timeout_ms,
                allow_changed_files: opts.allow_changed_files,
                lazy_pages: opts.lazy_pages,
                job_barrier: true,
            };
            timed(deadline, "RESTORE", node, self.agents.restore(node, req))
        });
        let restored = self
            .unless_stopped(join_all(calls))
            .await
            .and_then(all_ok)
            .and_then(|r| {
                for ((node, reply), (_, ts)) in r.iter().zip(&targets) {
                    if reply.pids.len() != ts.len() {
                        return Err(format!(
                            "node {node}: RESTORE returned {} pids for {} images",
                            reply.pids.len(),
                            ts.len()
                        ));
                    }
                }
                Ok(r)
            });
        let restored = match restored {
            Ok(r) => r,
            Err(reason) => {
                self.abort_all(&session, &dsts).await;
                clear_restarting();
                tracing::warn!(job, checkpoint = %id, "restart failed: {reason}");
                busy.end(
                    "failed",
                    format!("restart of {job} from {id}: failed: {reason}"),
                );
                return Err(fail(reason));
            }
        };
        // Where each image went: OLD_NODE:OLD_PID=NEW_NODE:NEW_PID.
        let placed: Vec<String> = restored
            .iter()
            .zip(&order)
            .flat_map(|((node, reply), (_, ks))| {
                ks.iter().zip(&reply.pids).map(move |(&k, pid)| {
                    format!("{}:{}={node}:{pid}", images[k].node, images[k].pid)
                })
            })
            .collect();
        tracing::info!(job, checkpoint = %id, phase = "restore", ms = ms(t.elapsed()), "phase done");
        fault::point("restore").await;

        // RELEASE
        busy.phase("releasing");
        let t = Instant::now();
        let release_deadline = deadline.max(t + BEST_EFFORT);
        let calls = dsts.iter().map(|n| {
            let req = pb::SessionRequest {
                session: session.clone(),
            };
            timed(release_deadline, "RELEASE", n, self.agents.release(n, req))
        });
        let mut members = Vec::new();
        let mut failed = Vec::new();
        let mut reasons = Vec::new();
        for (n, r) in join_all(calls).await {
            match r {
                Ok(reply) => {
                    self.registry.raise_generation(&n, reply.generation);
                    members.extend(
                        reply
                            .members
                            .iter()
                            .map(|m| MemberRecord::from_member(&n, m)),
                    );
                }
                Err(e) => {
                    reasons.push(format!("node {n}: {e}"));
                    failed.push(n);
                }
            }
        }
        if !failed.is_empty() {
            self.abort_all(&session, &failed).await;
        }
        let released_ms = ms(t0.elapsed());
        tracing::info!(job, checkpoint = %id, phase = "release", ms = ms(t.elapsed()), members = members.len(), "phase done");
        // JOBBACK: every node has let its members go, the job is back; only
        // now do their restart callbacks run (one may need a member on
        // another node). The members of a node whose RELEASE failed were
        // killed; the others run their callbacks all the same.
        let back_deadline = Instant::now() + BEST_EFFORT;
        let calls = dsts.iter().filter(|n| !failed.contains(n)).map(|n| {
            let req = pb::SessionRequest {
                session: session.clone(),
            };
            timed(back_deadline, "JOBBACK", n, self.agents.job_back(n, req))
        });
        for (n, r) in join_all(calls).await {
            if let Err(e) = r {
                tracing::warn!(job, checkpoint = %id, node = %n, "{e}: its members run their restart callbacks after the restore's timeout");
            }
        }
        self.change_job(job, |j| {
            j.members = members.clone();
            j.restarting.clear();
            j.restarted_unix_ms = started_unix_ms;
        })?;
        if !reasons.is_empty() {
            let reason = reasons.join("; ");
            tracing::warn!(job, checkpoint = %id, "restart failed: {reason}");
            busy.end(
                "failed",
                format!("restart of {job} from {id}: failed: {reason}"),
            );
            return Err(fail(reason));
        }

        // Unlock what the moved images left behind.
        let unlocks = group_by_node(
            images
                .iter()
                .zip(&plan.dst)
                .filter(|(img, dst)| **dst != img.node && live.is_up(&img.node))
                .map(|(img, _)| (img.node.clone(), img.dir.clone())),
        );
        if !unlocks.is_empty() {
            let deadline = Instant::now() + BEST_EFFORT;
            let calls = unlocks.iter().map(|(n, dirs)| {
                let req = pb::RemoveRequest { dirs: dirs.clone() };
                timed(deadline, "UNLOCK", n, self.agents.unlock(n, req))
            });
            for (n, r) in join_all(calls).await {
                if let Err(e) = r {
                    tracing::warn!(job, checkpoint = %id, node = %n, "{e}");
                }
            }
        }

        let duration_ms = ms(t0.elapsed());
        tracing::info!(job, checkpoint = %id, ms = duration_ms, processes = members.len(), "restart done");
        busy.end(
            "done",
            format!(
                "restart of {job} from {id}: done in {duration_ms} ms, {} processes running",
                members.len()
            ),
        );
        Ok(pb::RestartReply {
            job: job.into(),
            checkpoint: id,
            procs: members
                .iter()
                .map(|m| pb::ProcInfo {
                    node: m.node.clone(),
                    pid: m.pid,
                    uid: m.uid,
                    command: m.command.clone(),
                    alive: true,
                })
                .collect(),
            duration_ms,
            map_addr,
            fetched_bytes: fetched.bytes,
            fetch_ms,
            placed,
            released_ms,
        })
    }

    /// Copy every image that `plan` restores away from its node to its
    /// target, from its node or, when that is down, from a node holding a
    /// replica; the copies are recorded as replicas of the checkpoint.
    async fn fetch_images(
        &self,
        busy: &Busy<'_>,
        job: &str,
        ck: &CheckpointRecord,
        plan: &migrate::Plan,
        live: &crate::registry::Liveness,
        how: Copying,
    ) -> Result<Fetched, String> {
        let id = ck.id();
        let node_recs = self.catalog.read(|s| s.nodes.clone());
        let mut out = Fetched::default();
        let mut calls = Copies::new();
        for (k, img) in ck.info().images.iter().enumerate() {
            let dst = &plan.dst[k];
            if *dst == img.node {
                continue;
            }
            let holders = holders(img);
            if let Some((_, d)) = holders.iter().find(|(n, _)| n == dst) {
                out.dirs.insert(k, d.clone());
                continue;
            }
            let Some((src, dir)) = holders.into_iter().find(|(n, _)| live.is_up(n)) else {
                return Err(format!(
                    "no node holding the image of {}:{} is up",
                    img.node, img.pid
                ));
            };
            add_copy(&mut calls, dst, &src, k, dir);
        }
        if calls.is_empty() {
            return Ok(out);
        }
        busy.phase("fetching images");
        let what = format!("restart of {job} from {id}");
        for ((dst, _), r) in self
            .copy_images(job, id, &what, &calls, &node_recs, how)
            .await
        {
            let (dirs, bytes) = r.map_err(|e| format!("node {dst}: {e}"))?;
            out.bytes += bytes;
            out.dirs.extend(dirs);
        }
        Ok(out)
    }

    /// Replication after a commit: each image of checkpoint `rec` copied to
    /// `replicas - 1` nodes that are up and do not hold it yet (the nodes
    /// holding the fewest copies of it first, then by name), recorded as its
    /// replicas. Best effort: the checkpoint stays committed whatever
    /// happens, and a copy that failed is said in its notes.
    async fn replicate(&self, busy: &Busy<'_>, rec: &mut CheckpointRecord, replicas: u32) {
        if replicas <= 1 {
            return;
        }
        let id = rec.id().to_string();
        let job = rec.info().job.clone();
        let live = self.liveness();
        let node_recs = self.catalog.read(|s| s.nodes.clone());
        let mut up: Vec<&String> = node_recs.keys().filter(|n| live.is_up(n)).collect();
        up.sort();
        let mut load: HashMap<&str, usize> = HashMap::new();
        let mut calls = Copies::new();
        let mut short = Vec::new();
        for (k, img) in rec.info().images.iter().enumerate() {
            let holders = holders(img);
            let Some((src, dir)) = holders.iter().find(|(n, _)| live.is_up(n)).cloned() else {
                short.push(format!(
                    "{}:{} (no node holding it is up)",
                    img.node, img.pid
                ));
                continue;
            };
            let mut free: Vec<&String> = up
                .iter()
                .copied()
                .filter(|n| !holders.iter().any(|(h, _)| h == *n))
                .collect();
            free.sort_by_key(|n| load.get(n.as_str()).copied().unwrap_or(0));
            let want = (replicas as usize).saturating_sub(holders.len());
            if free.len() < want {
                short.push(format!(
                    "{}:{} ({} nodes up to copy it to, {want} wanted)",
                    img.node,
                    img.pid,
                    free.len()
                ));
            }
            for dst in free.into_iter().take(want) {
                *load.entry(dst.as_str()).or_default() += 1;
                add_copy(&mut calls, dst, &src, k, dir.clone());
            }
        }
        if !short.is_empty() {
            rec.info_mut().notes.push(format!(
                "fewer than {replicas} copies of: {}",
                short.join(", ")
            ));
        }
        if calls.is_empty() {
            if !short.is_empty() {
                self.record(rec);
            }
            return;
        }
        busy.phase("replicating");
        let t = Instant::now();
        let deadline = t + self.settings.timeout;
        let what = format!("replica of {id}");
        let mut bytes = 0;
        for ((dst, src), r) in self
            .copy_images(
                &job,
                &id,
                &what,
                &calls,
                &node_recs,
                Copying {
                    deadline,
                    lazy: false,
                },
            )
            .await
        {
            match r {
                Ok((_, b)) => bytes += b,
                Err(e) => {
                    tracing::warn!(job, checkpoint = %id, node = %dst, "replica from {src} failed: {e}");
                    rec.info_mut().notes.push(format!(
                        "no replica on {dst}: the copy from {src} failed ({e})"
                    ));
                }
            }
        }
        // The copies just recorded by copy_images, and the notes.
        if let Some(c) = self.catalog.read(|s| s.checkpoint(&id).cloned()) {
            let notes = rec.info().notes.clone();
            *rec = c;
            rec.info_mut().notes = notes;
        }
        self.record(rec);
        tracing::info!(job, checkpoint = %id, bytes, ms = ms(t.elapsed()), copies = calls.iter().map(|(_, v)| v.len()).sum::<usize>(), "checkpoint replicated");
    }

    /// Record checkpoint `rec` as it is now (its replicas and notes).
    fn record(&self, rec: &CheckpointRecord) {
        if let Err(e) = self
            .catalog
            .update(|_| Ok::<_, Error>((vec![Change::Checkpoint(rec.clone())], ())))
        {
            tracing::error!(checkpoint = %rec.id(), "cannot record the replication: {e}");
        }
    }

    /// The FETCH calls of `calls`, in parallel: for each, the directories
    /// of its images on its target (by image index) and the bytes copied,
    /// or why it failed. Every copy made is recorded as a replica of
    /// checkpoint `id`. With `lazy` (a post-copy restart) the page stores
    /// are left to come while the restored processes run (see
    /// `pb::FetchRequest::lazy`): the copy is complete once they are in.
    async fn copy_images(
        &self,
        job: &str,
        id: &str,
        what: &str,
        calls: &Copies,
        node_recs: &BTreeMap<String, NodeRecord>,
        how: Copying,
    ) -> Vec<(NodePair, CopyResult)> {
        let Copying { deadline, lazy } = how;
        let timeout_ms = ms(deadline.saturating_duration_since(Instant::now())) as u32;
        let results = join_all(calls.iter().map(|((dst, src), imgs)| {
            let req = pb::FetchRequest {
                from_node: src.clone(),
                from_addr: node_recs
                    .get(src)
                    .map(|n| n.agent_addr.clone())
                    .unwrap_or_default(),
                dirs: imgs.iter().map(|(_, d)| d.clone()).collect(),
                what: what.to_string(),
                timeout_ms,
                lazy,
                job: job.to_string(),
            };
            let what = format!("FETCH from {src}");
            async move { timed(deadline, &what, dst, self.agents.fetch(dst, req)).await }
        }))
        .await;
        let mut replicas: Vec<(usize, String)> = Vec::new();
        let mut out = Vec::new();
        for ((pair, imgs), (_, r)) in calls.iter().zip(results) {
            let r = r.and_then(|r| {
                if r.dirs.len() != imgs.len() {
                    return Err(format!(
                        "FETCH returned {} directories for {} images",
                        r.dirs.len(),
                        imgs.len()
                    ));
                }
                Ok((
                    imgs.iter().map(|(k, _)| *k).zip(r.dirs).collect::<Vec<_>>(),
                    r.bytes,
                ))
            });
            if let Ok((dirs, _)) = &r {
                replicas.extend(dirs.iter().map(|(k, d)| (*k, format!("{}={d}", pair.0))));
            }
            out.push((pair.clone(), r));
        }
        if replicas.is_empty() {
            return out;
        }
        let res = self.catalog.update(|s| {
            let Some(mut c) = s.checkpoint(id).cloned() else {
                return Ok::<_, Error>((vec![], ()));
            };
            for (k, r) in &replicas {
                if let Some(img) = c.info_mut().images.get_mut(*k) {
                    if !img.replicas.contains(r) {
                        img.replicas.push(r.clone());
                    }
                }
            }
            Ok((vec![Change::Checkpoint(c)], ()))
        });
        if let Err(e) = res {
            tracing::warn!(job, checkpoint = id, "cannot record the replicas: {e}");
        }
        out
    }
}

/// The nodes holding image `img`, with its directory there: the node that
/// wrote it, then its replicas.
/// How images are copied between agents: by when, and whether their page
/// stores are left to come while the restored processes run (post-copy).
#[derive(Clone, Copy)]
struct Copying {
    deadline: Instant,
    lazy: bool,
}

fn holders(img: &pb::ImageInfo) -> Vec<(String, String)> {
    std::iter::once((img.node.clone(), img.dir.clone()))
        .chain(img.replicas.iter().filter_map(|r| {
            r.split_once('=')
                .map(|(n, d)| (n.to_string(), d.to_string()))
        }))
        .collect()
}

/// Add image `k` (directory `dir` on `src`) to the FETCH from `src` to `dst`.
fn add_copy(calls: &mut Copies, dst: &str, src: &str, k: usize, dir: String) {
    let key = (dst.to_string(), src.to_string());
    match calls.iter_mut().find(|(c, _)| *c == key) {
        Some((_, v)) => v.push((k, dir)),
        None => calls.push((key, vec![(k, dir)])),
    }
}

/// FETCH calls: for each (target, source), the images it copies (index in
/// the checkpoint, directory on the source).
type Copies = Vec<(NodePair, Vec<(usize, String)>)>;

/// What a FETCH made: (image index, directory on the target) and bytes.
type CopyResult = Result<(Vec<(usize, String)>, u64), String>;

/// (target, source) of a FETCH; with it, each image's index and its
/// directory on the source.
type NodePair = (String, String);

/// The images a restart copied: their directories on their targets (by
/// image index) and the bytes copied.
#[derive(Default)]
struct Fetched {
    dirs: HashMap<usize, String>,
    bytes: u64,
}
