//! Placement of a restart, migration (stop-and-copy) and drain.
//!
//! A restart places each image of a checkpoint on a node ([`Placement`]):
//! whole nodes (`crctl restart --on`: every address of a moved node is
//! rewritten) or single members (a migration: only the endpoints of the
//! moved member's connections are rewritten, `OLD:PORT=NEW`, in every
//! image, so that its peers, restored in place, reach it at its new
//! address while their other connections keep theirs). An image restored
//! on a node that lacks it is first fetched there from a node that holds
//! it (see `cr-agent`'s transfer module).
//!
//! A migration of job J is: record it in the catalog → a coordinated
//! checkpoint with KILL → a restart with the moved members on their
//! targets (images fetched there). If the restart fails (the target died,
//! the link was cut during the copy, the restore failed), the job is
//! restarted from the same checkpoint where it was (rolled back). A
//! migration found in the catalog when the coordinator starts was cut
//! short: once the job's nodes are up it is rolled back unless the job
//! runs (then it finished, or its checkpoint never killed anything).
//! With pre-copy (`--pre-copy`, or the job's setting) the checkpoint is
//! preceded by pre-dump rounds of every member ([`crate::precopy`]), the
//! moved members' rounds fetched by their targets, so that the freeze
//! writes and the restart copies only what changed since; retention runs
//! once the job runs again (not during the downtime).
//!
//! Without a target (`crctl migrate` without `--to`), the members go to
//! the node [`crate::placement`] chooses among those up, undrained and not
//! running a moved member: the member's, or the whole job's, size must
//! fit in its free memory. A restart without `--on`
//! ([`Placement::Auto`]) restores every image where it was made, except
//! those of a node that is down, unknown or drained: each such node's
//! images go together to the node placement chooses (its addresses
//! rewritten as with `--on`).
//!
//! A drain marks the node drained (no new member is placed or accepted
//! there; a restart elsewhere never picks it) and migrates every job's
//! members off it, to the up, undrained nodes chosen by free memory
//! and CPU (a job's members there together when a node has room, else
//! in their groups connected over loopback: `drain_plan`;
//! [`crate::placement`]; Slurm jobs excepted: Slurm moves them,
//! see [`slurm_job`]). A member no node has room for refuses the drain
//! before anything is moved or the node is marked.

use crate::catalog::{Change, MigrationRecord, NodeRecord};
use crate::coordinator::{now_unix_ms, Coordinator};
use crate::error::Error;
use crate::protocol::{CheckpointOpts, RestartOpts};
use cr_rpc::pb;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

/// Where the images of a checkpoint are restored.
#[derive(Debug, Clone)]
pub enum Placement {
    /// The i-th node of the checkpoint (in host-list order,
    /// [`crate::catalog::node_order`]) goes to `on[i %
    /// len]`; empty: every image where it was made.
    Nodes(Vec<String>),
    /// These members (node, pid in the checkpoint) go to the node named;
    /// the others stay.
    Members(HashMap<(String, i32), String>),
    /// Every image where it was made, but those of a node that is down,
    /// unknown or drained on the node [`crate::placement`] chooses, a
    /// whole node at a time (`crctl restart` without `--on`). Resolved
    /// into [`Placement::Nodes`] by the restart once it knows the
    /// checkpoint; [`plan`] takes it as the same nodes.
    Auto,
}

/// The restart's plan: per image (in the checkpoint's order) its node and
/// its own rewrites, and the rewrites of every image.
#[derive(Debug, Default)]
pub struct Plan {
    pub dst: Vec<String>,
    pub own_map: Vec<Vec<String>>,
    pub map_addr: Vec<String>,
}

/// `a` with an IPv4-mapped IPv6 address as IPv4 (how AddrMap compares).
fn canon(a: SocketAddr) -> SocketAddr {
    match a.ip() {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), a.port()),
            None => a,
        },
        IpAddr::V4(_) => a,
    }
}

/// `pids` (members on `node`) in groups connected over loopback in
/// checkpoint `ck` (a member it did not hold is a group of its own), in
/// the order of `pids`.
fn loopback_groups(ck: Option<&pb::CheckpointInfo>, node: &str, pids: &[i32]) -> Vec<Vec<i32>> {
    let here: Vec<&pb::ImageInfo> = ck
        .map(|c| c.images.iter().filter(|i| i.node == node).collect())
        .unwrap_or_default();
    let mut links = Vec::new();
    for a in &here {
        let lo = a
            .bookmarks
            .iter()
            .filter(|b| sockaddr(&b.local).is_some_and(|l| l.ip().is_loopback()));
        for b in lo {
            for o in &here {
                if o.pid != a.pid && o.bookmarks.iter().any(|ob| ob.local == b.remote) {
                    links.push((a.pid, o.pid));
                }
            }
        }
    }
    // Union of the linked members, in the order of `pids`.
    let mut group: Vec<usize> = (0..pids.len()).collect();
    fn root(g: &mut [usize], mut i: usize) -> usize {
        while g[i] != i {
            g[i] = g[g[i]];
            i = g[i];
        }
        i
    }
    for (a, b) in links {
        let (Some(i), Some(j)) = (
            pids.iter().position(|&p| p == a),
            pids.iter().position(|&p| p == b),
        ) else {
            continue;
        };
        let (ri, rj) = (root(&mut group, i), root(&mut group, j));
        group[ri.max(rj)] = ri.min(rj);
    }
    let mut out: Vec<Vec<i32>> = Vec::new();
    let mut slot: HashMap<usize, usize> = HashMap::new();
    for (i, &pid) in pids.iter().enumerate() {
        let r = root(&mut group, i);
        let k = *slot.entry(r).or_insert_with(|| {
            out.push(Vec::new());
            out.len() - 1
        });
        out[k].push(pid);
    }
    out
}

fn sockaddr(s: &str) -> Option<SocketAddr> {
    s.parse::<SocketAddr>().ok().map(canon)
}

/// The nodes of the images of `ck`, in host-list order
/// ([`crate::catalog::node_order`]): how [`Placement::Nodes`] numbers them.
pub fn source_nodes(ck: &pb::CheckpointInfo) -> Vec<&str> {
    let mut sources: Vec<&str> = ck.images.iter().map(|i| i.node.as_str()).collect();
    sources.sort_by(|a, b| crate::catalog::node_order(a, b));
    sources.dedup();
    sources
}

/// The plan of `placement` for the images of `ck`, with the nodes' records.
pub fn plan(
    job: &str,
    ck: &pb::CheckpointInfo,
    nodes: &BTreeMap<String, NodeRecord>,
    placement: &Placement,
) -> Result<Plan, String> {
    let mut out = Plan::default();
    let same = Vec::new();
    match placement {
        Placement::Nodes(_) | Placement::Auto => {
            let on = match placement {
                Placement::Nodes(on) => on,
                _ => &same,
            };
            let sources = source_nodes(ck);
            let place: HashMap<&str, &str> = sources
                .iter()
                .enumerate()
                .map(|(i, n)| {
                    let dst = if on.is_empty() {
                        n
                    } else {
                        on[i % on.len()].as_str()
                    };
                    (*n, dst)
                })
                .collect();
            out.dst = ck
                .images
                .iter()
                .map(|i| place[i.node.as_str()].to_string())
                .collect();
            out.own_map = vec![Vec::new(); ck.images.len()];
            let mut mapped = HashSet::new();
            for src in &sources {
                let dst = place[src];
                if dst == *src {
                    continue;
                }
                let (Some(s), Some(d)) = (nodes.get(*src), nodes.get(dst)) else {
                    continue;
                };
                if s.addresses.len() > d.addresses.len() {
                    tracing::warn!(
                        job,
                        from = %src,
                        to = dst,
                        "node {src} has more addresses than {dst}: the extra ones are not rewritten"
                    );
                }
                for (old, new) in s.addresses.iter().zip(&d.addresses) {
                    let m = format!("{old}={new}");
                    if old != new && mapped.insert(m.clone()) {
                        out.map_addr.push(m);
                    }
                }
            }
        }
        Placement::Members(moves) => {
            out.dst = ck
                .images
                .iter()
                .map(|i| {
                    moves
                        .get(&(i.node.clone(), i.pid))
                        .cloned()
                        .unwrap_or_else(|| i.node.clone())
                })
                .collect();
            // The moved endpoints: old local address → the target's
            // address in the same position of its list.
            let mut endpoint: HashMap<SocketAddr, IpAddr> = HashMap::new();
            let mut whole: Vec<Option<(Vec<String>, Vec<String>)>> = vec![None; ck.images.len()];
            for (k, img) in ck.images.iter().enumerate() {
                let dst = &out.dst[k];
                if *dst == img.node {
                    continue;
                }
                let (Some(s), Some(d)) = (nodes.get(&img.node), nodes.get(dst)) else {
                    return Err(format!("node {} or {dst} is not registered", img.node));
                };
                let pairs: HashMap<IpAddr, IpAddr> = s
                    .addresses
                    .iter()
                    .zip(&d.addresses)
                    .filter_map(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
                    .collect();
                for b in &img.bookmarks {
                    let Some(local) = sockaddr(&b.local) else {
                        continue;
                    };
                    if local.ip().is_loopback() {
                        // Both ends must move together.
                        let peer = ck.images.iter().enumerate().find(|(_, o)| {
                            o.node == img.node && o.bookmarks.iter().any(|ob| ob.local == b.remote)
                        });
                        if let Some((_, o)) = peer.filter(|(j, _)| out.dst[*j] != *dst) {
                            return Err(format!(
                                "member {}:{} is connected to member {}:{} over loopback ({} -> {}): move them together",
                                img.node, img.pid, o.node, o.pid, b.local, b.remote
                            ));
                        }
                        continue;
                    }
                    match pairs.get(&local.ip()) {
                        Some(new) => {
                            endpoint.insert(local, *new);
                        }
                        None => {
                            return Err(format!(
                                "member {}:{} uses address {} that node {} does not list: it cannot be rewritten for {dst}",
                                img.node,
                                img.pid,
                                local.ip(),
                                img.node
                            ))
                        }
                    }
                }
                whole[k] = Some((s.addresses.clone(), d.addresses.clone()));
            }
            let mut map: Vec<String> = endpoint
                .iter()
                .filter(|(old, new)| old.ip() != **new)
                .map(|(old, new)| format!("{old}={new}"))
                .collect();
            map.sort();
            out.map_addr = map;
            // A moved image's own addresses (listeners, unconnected
            // sockets) follow it, unless it talks to a peer that stays at
            // one of them (its address must then stay as it is).
            out.own_map = vec![Vec::new(); ck.images.len()];
            for (k, img) in ck.images.iter().enumerate() {
                let Some((old, new)) = &whole[k] else {
                    continue;
                };
                let stays = img.bookmarks.iter().any(|b| {
                    sockaddr(&b.remote).is_some_and(|r| {
                        old.iter().any(|o| o.parse::<IpAddr>().ok() == Some(r.ip()))
                            && !endpoint.contains_key(&r)
                    })
                });
                if stays {
                    continue;
                }
                out.own_map[k] = old
                    .iter()
                    .zip(new)
                    .filter(|(o, n)| o != n)
                    .map(|(o, n)| format!("{o}={n}"))
                    .collect();
            }
        }
    }
    Ok(out)
}

impl Coordinator {
    /// Whether `node` is drained.
    pub fn is_drained(&self, node: &str) -> bool {
        self.catalog
            .read(|s| s.nodes.get(node).is_some_and(|n| n.drained))
    }

    /// `crctl migrate`: the members named by `member` (NODE:PID or #INDEX;
    /// empty: all) of `job` to node `to` (empty: the node placement
    /// chooses, see [`Coordinator::choose_target`]).
    pub async fn migrate(
        &self,
        job: &str,
        member: &str,
        to: &str,
        timeout: Option<Duration>,
        pre_copy: bool,
        lazy: bool,
    ) -> Result<pb::MigrateReply, Error> {
        let live = self.liveness();
        let jobrec = self
            .catalog
            .read(|s| s.jobs.get(job).cloned())
            .ok_or_else(|| Error::UnknownJob { job: job.into() })?;
        let alive: Vec<_> = jobrec.members.iter().filter(|m| m.alive).collect();
        let chosen: Vec<_> = if member.is_empty() {
            alive.clone()
        } else if let Some(i) = member.strip_prefix('#') {
            let i: usize = i.parse().map_err(|_| Error::Invalid {
                what: format!("member {member:?}: expected NODE:PID or #INDEX"),
            })?;
            let m = jobrec
                .members
                .get(i.wrapping_sub(1))
                .ok_or_else(|| Error::Invalid {
                    what: format!(
                        "job {job} has no member #{i} (it has {})",
                        jobrec.members.len()
                    ),
                })?;
            vec![m]
        } else {
            let (node, pid) = member
                .rsplit_once(':')
                .and_then(|(n, p)| Some((n, p.parse::<i32>().ok()?)))
                .ok_or_else(|| Error::Invalid {
                    what: format!("member {member:?}: expected NODE:PID or #INDEX"),
                })?;
            let m = jobrec
                .members
                .iter()
                .find(|m| m.node == node && m.pid == pid)
                .ok_or_else(|| Error::Invalid {
                    what: format!(
                        "job {job} has no member {node}:{pid} (members: {})",
                        jobrec
                            .members
                            .iter()
                            .map(|m| format!("{}:{}", m.node, m.pid))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                })?;
            vec![m]
        };
        if chosen.is_empty() {
            return Err(Error::NoLiveMember { job: job.into() });
        }
        if let Some(m) = chosen.iter().find(|m| !m.alive) {
            return Err(Error::Invalid {
                what: format!("member {}:{} of job {job} is not running", m.node, m.pid),
            });
        }
        let to = if to.is_empty() {
            let sized: Vec<(String, i32, u64)> = chosen
                .iter()
                .map(|m| {
                    let bytes = self.member_bytes(job, &m.node, m.pid, &live);
                    (m.node.clone(), m.pid, bytes)
                })
                .collect();
            let what = if member.is_empty() {
                format!("job {job} ({} members)", sized.len())
            } else {
                format!("member {}:{}", sized[0].0, sized[0].1)
            };
            self.choose_target(&format!("migrate job {job}"), &what, &sized, &live)?
        } else {
            to.to_string()
        };
        let to = to.as_str();
        let moves: HashMap<(String, i32), String> = chosen
            .iter()
            .filter(|m| m.node != to)
            .map(|m| ((m.node.clone(), m.pid), to.to_string()))
            .collect();
        if moves.is_empty() {
            return Err(Error::Invalid {
                what: format!("nothing to move: the members named are on {to} already"),
            });
        }
        self.check_target(job, to, &live)?;
        self.migrate_moves(job, moves, timeout, pre_copy, lazy)
            .await
    }

    /// The node `members` (node, pid, bytes) all go to when no target is
    /// named: one that is up, undrained and none of theirs, with room for
    /// all of them ([`crate::placement`]); else why none (`op`, `what`:
    /// for the message).
    fn choose_target(
        &self,
        op: &str,
        what: &str,
        members: &[(String, i32, u64)],
        live: &crate::registry::Liveness,
    ) -> Result<String, Error> {
        use crate::placement::{place, Sized};
        let bytes: u64 = members.iter().map(|m| m.2).sum();
        let nodes = self.candidates(live, |n| members.iter().any(|m| m.0 == n));
        let no_target = |best: String| Error::NoTarget {
            op: op.into(),
            flag: "--to".into(),
            what: what.into(),
            mib: bytes.div_ceil(1 << 20),
            best,
        };
        match place(&nodes, &[Sized { key: (), bytes }]) {
            Ok(p) => {
                let (_, to) = p
                    .into_iter()
                    .next()
                    .ok_or_else(|| no_target("no other node is up and undrained".into()))?;
                tracing::info!(what, bytes, to, "target chosen by free memory and CPU");
                Ok(to)
            }
            Err(e) => {
                tracing::warn!(what, bytes, "no target has room");
                Err(no_target(e.best_text()))
            }
        }
    }

    /// [`Placement::Auto`] for checkpoint `ck` of `job`: every node of the
    /// checkpoint (in host-list order) to itself when it is up and
    /// undrained, else its images, together, to the node placement
    /// chooses, where the images staying there count as used memory.
    pub(crate) fn auto_placement(
        &self,
        job: &str,
        ck: &pb::CheckpointInfo,
        nodes: &BTreeMap<String, NodeRecord>,
        live: &crate::registry::Liveness,
    ) -> Result<Placement, Error> {
        use crate::placement::{place, Sized};
        let sources = source_nodes(ck);
        let size = |n: &str| -> u64 {
            ck.images
                .iter()
                .filter(|i| i.node == n)
                .map(|i| i.page_bytes)
                .sum()
        };
        let why_not = |n: &str| match nodes.get(n) {
            None => Some("unknown"),
            Some(r) if r.drained => Some("drained"),
            Some(_) if !live.is_up(n) => Some("down"),
            Some(_) => None,
        };
        let gone: Vec<Sized<String>> = sources
            .iter()
            .filter(|n| why_not(n).is_some())
            .map(|n| Sized {
                key: n.to_string(),
                bytes: size(n),
            })
            .collect();
        if gone.is_empty() {
            return Ok(Placement::Nodes(Vec::new()));
        }
        let mut cands = self.candidates(live, |_| false);
        for c in &mut cands {
            if let Some(cap) = &mut c.capacity {
                cap.mem_free = cap.mem_free.saturating_sub(size(&c.name));
            }
        }
        let no_target = |n: &str, bytes: u64, best: String| Error::NoTarget {
            op: format!("restart job {job} from {}", ck.id),
            flag: "--on".into(),
            what: format!("the images of {n} ({})", why_not(n).unwrap_or("up")),
            mib: bytes.div_ceil(1 << 20),
            best,
        };
        let placed: HashMap<String, String> = match place(&cands, &gone) {
            Ok(p) if p.len() == gone.len() => p.into_iter().collect(),
            Ok(_) => {
                return Err(no_target(
                    &gone[0].key,
                    gone[0].bytes,
                    "no node is up and undrained".into(),
                ))
            }
            Err(e) => return Err(no_target(&e.key, e.bytes, e.best_text())),
        };
        let on: Vec<String> = sources
            .iter()
            .map(|n| placed.get(*n).cloned().unwrap_or_else(|| n.to_string()))
            .collect();
        tracing::info!(job, checkpoint = %ck.id, moved = ?placed, "restart: nodes down or drained replaced by free memory and CPU");
        Ok(Placement::Nodes(on))
    }

    /// The nodes members may go to: up, undrained, not `excluded`, with
    /// their capacity and live members.
    fn candidates(
        &self,
        live: &crate::registry::Liveness,
        excluded: impl Fn(&str) -> bool,
    ) -> Vec<crate::placement::Candidate> {
        self.catalog.read(|s| {
            s.nodes
                .values()
                .filter(|n| !n.drained && !excluded(&n.name) && live.is_up(&n.name))
                .map(|n| crate::placement::Candidate {
                    name: n.name.clone(),
                    capacity: live.capacity(&n.name).cloned(),
                    members: s
                        .on_node(&n.name)
                        .map(|(j, ks)| ks.iter().filter(|&&k| j.members[k].alive).count())
                        .sum(),
                })
                .collect()
        })
    }

    /// `to` can take members: registered, up, not drained.
    fn check_target(
        &self,
        job: &str,
        to: &str,
        live: &crate::registry::Liveness,
    ) -> Result<(), Error> {
        let (known, rec) = self.catalog.read(|s| {
            (
                s.nodes.keys().take(10).cloned().collect::<Vec<_>>(),
                s.nodes.get(to).cloned(),
            )
        });
        let Some(rec) = rec else {
            return Err(Error::UnknownNode {
                node: to.into(),
                known: known.join(", "),
            });
        };
        if rec.drained {
            return Err(Error::Drained { node: to.into() });
        }
        if !live.is_up(to) {
            return Err(Error::NodeDown {
                job: job.into(),
                node: to.into(),
                why: live.down_reason(to),
            });
        }
        Ok(())
    }

    fn set_migration(&self, job: &str, m: Option<MigrationRecord>) -> Result<(), Error> {
        self.change_job(job, |j| j.migration = m)
    }

    /// Stop-and-copy of `moves` (see the module doc); with `lazy` the
    /// restart puts the private anonymous pages in after the trees run.
    pub async fn migrate_moves(
        &self,
        job: &str,
        moves: HashMap<(String, i32), String>,
        timeout: Option<Duration>,
        pre_copy: bool,
        lazy: bool,
    ) -> Result<pb::MigrateReply, Error> {
        let t0 = Instant::now();
        let mut rec = MigrationRecord {
            moves: moves
                .iter()
                .map(|((n, p), t)| format!("{n}:{p}={t}"))
                .collect(),
            checkpoint: String::new(),
            started_unix_ms: now_unix_ms(),
        };
        rec.moves.sort();
        if self
            .catalog
            .read(|s| s.jobs.get(job).and_then(|j| j.migration.clone()))
            .is_some()
        {
            return Err(Error::Busy {
                job: job.into(),
                what: "a migration".into(),
            });
        }
        self.set_migration(job, Some(rec.clone()))?;
        tracing::info!(job, moves = ?rec.moves, "migration started");
        // With pre-copy, every member is pre-dumped while the job runs, the
        // moved ones fetched by their targets after each round.
        // (The job's own pre-copy setting applies to its migrations too.)
        let pre_copy = pre_copy
            || self
                .catalog
                .read(|s| s.jobs.get(job).is_some_and(|j| j.pre_copy));
        self.events
            .migration_started(job, &rec.moves, pre_copy, lazy);
        let res = self
            .migrate_recorded(job, &moves, rec, timeout, (pre_copy, lazy), t0)
            .await;
        self.events.migration_end(
            job,
            match &res {
                Ok(r) => Ok(r.downtime_ms),
                Err(Error::MigrationFailed { reason, .. }) => Err((
                    reason.clone(),
                    reason.contains("the job was restarted where it was"),
                )),
                Err(e) => Err((e.to_string(), false)),
            },
        );
        res
    }

    /// [`Coordinator::migrate_moves`] once recorded as `rec`: the
    /// checkpoint, then the restart on the targets, or the roll back.
    async fn migrate_recorded(
        &self,
        job: &str,
        moves: &HashMap<(String, i32), String>,
        mut rec: MigrationRecord,
        timeout: Option<Duration>,
        (pre_copy, lazy): (bool, bool),
        t0: Instant,
    ) -> Result<pb::MigrateReply, Error> {
        let failed = |reason: String| Error::MigrationFailed {
            job: job.into(),
            reason,
        };
        let opts = CheckpointOpts {
            timeout,
            pre_copy: pre_copy.then(|| moves.clone()),
            defer_retention: true,
            // Restored on their targets: their exit (the unmapping of
            // their memory) is not waited for inside the downtime.
            exit_later: moves.keys().cloned().collect(),
            ..Default::default()
        };
        let ck = match self.checkpoint_on(job, pb::After::Kill, &opts).await {
            Ok(ck) => ck,
            Err(e) => {
                let _ = self.set_migration(job, None);
                return Err(failed(format!("{e}; the job runs on where it was")));
            }
        };
        if !ck.unfinished.is_empty() {
            let _ = self.set_migration(job, None);
            return Err(failed(format!(
                "checkpoint {} could not stop the members on {}: they run on there; the others are stopped at {} (crctl restart {job} once they are stopped too)",
                ck.id,
                ck.unfinished.join(", "),
                ck.id
            )));
        }
        rec.checkpoint = ck.id.clone();
        self.set_migration(job, Some(rec.clone()))?;
        crate::fault::point("migrate").await;
        let restart_at = t0.elapsed();
        let placement = Placement::Members(moves.clone());
        let res = self
            .restart_placed(
                job,
                Some(&ck.id),
                &placement,
                &RestartOpts {
                    timeout,
                    lazy_pages: lazy,
                    ..Default::default()
                },
            )
            .await;
        match res {
            Ok(r) => {
                let _ = self.set_migration(job, None);
                // From the freeze to the release of every member (they
                // run from then on). Before the freeze, the pre-copy and
                // PREPARE's round of callbacks and checks: the members run
                // then, their connections not held yet (the network locks
                // go in at FREEZE).
                let duration_ms = t0.elapsed().as_millis() as u64;
                let released_ms = restart_at.as_millis() as u64 + r.released_ms;
                let downtime_ms = released_ms.saturating_sub(ck.pre_copy_ms + ck.callbacks_ms);
                let mut moved: Vec<String> = r
                    .placed
                    .iter()
                    .filter_map(|pl| pl.split_once('='))
                    .filter(|(old, _)| {
                        old.rsplit_once(':').is_some_and(|(n, p)| {
                            p.parse()
                                .is_ok_and(|p: i32| moves.contains_key(&(n.to_string(), p)))
                        })
                    })
                    .map(|(old, new)| format!("{old} -> {new}"))
                    .collect();
                moved.sort();
                tracing::info!(job, checkpoint = %ck.id, ms = downtime_ms, bytes = r.fetched_bytes, copy_ms = r.fetch_ms, moved = ?moved, "migration done");
                // Older checkpoints go now that the job runs again.
                self.retain(job).await;
                Ok(pb::MigrateReply {
                    job: job.into(),
                    checkpoint: ck.id.clone(),
                    moved,
                    downtime_ms,
                    duration_ms,
                    bytes: r.fetched_bytes,
                    copy_ms: r.fetch_ms,
                    procs: r.procs,
                    rounds: ck.pre_copy_rounds,
                    pre_copy_bytes: ck.pre_copy_fetched,
                    pre_copy_ms: ck.pre_copy_ms,
                })
            }
            Err(e) => {
                tracing::warn!(job, checkpoint = %ck.id, "migration failed ({e}): rolling back");
                let back = self.roll_back(job, &ck.id, timeout).await;
                let _ = self.set_migration(job, None);
                Err(failed(match back {
                    Ok(()) => format!("{e}; the job was restarted where it was from {}", ck.id),
                    Err(e2) => format!(
                        "{e}; restarting it where it was failed too ({e2}): the job is stopped at checkpoint {}",
                        ck.id
                    ),
                }))
            }
        }
    }

    /// Restart `job` from `id` where its images were made.
    async fn roll_back(&self, job: &str, id: &str, timeout: Option<Duration>) -> Result<(), Error> {
        // A restart lost with a target node is aborted there; the restart
        // in place may need a moment for the job's slot.
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            match self
                .restart_placed(
                    job,
                    Some(id),
                    &Placement::Nodes(Vec::new()),
                    &RestartOpts {
                        timeout,
                        ..Default::default()
                    },
                )
                .await
            {
                Err(Error::Busy { .. }) if Instant::now() < until => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                r => return r.map(|_| tracing::info!(job, checkpoint = id, "rolled back")),
            }
        }
    }

    /// Migrations cut short by a restart of the coordinator: rolled back
    /// once the job's nodes are up, unless the job runs (see the module
    /// doc). Runs in the background.
    pub async fn recover_migrations(&self) {
        let pending: Vec<(String, MigrationRecord)> = self.catalog.read(|s| {
            s.jobs
                .values()
                .filter_map(|j| j.migration.clone().map(|m| (j.name.clone(), m)))
                .collect()
        });
        for (job, m) in pending {
            tracing::info!(job, checkpoint = %m.checkpoint, "a migration was cut short by a restart of the coordinator");
            if m.checkpoint.is_empty() {
                // Its checkpoint was aborted at open: the job ran on.
                let _ = self.set_migration(&job, None);
                continue;
            }
            let nodes = self.catalog.read(|s| {
                s.checkpoint(&m.checkpoint)
                    .map(|c| c.nodes())
                    .unwrap_or_default()
            });
            let until = Instant::now() + self.settings.timeout;
            while Instant::now() < until && !nodes.iter().all(|n| self.liveness().is_up(n)) {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            // The members report themselves as the agents register.
            tokio::time::sleep(Duration::from_millis(self.settings.heartbeat_ms as u64)).await;
            let live = self.liveness();
            let running = self.catalog.read(|s| {
                s.jobs.get(&job).map_or(0, |j| {
                    j.members
                        .iter()
                        .filter(|m| m.alive && live.is_up(&m.node))
                        .count()
                })
            });
            if running > 0 {
                tracing::info!(job, "the job runs: the migration is over");
            } else {
                match self.roll_back(&job, &m.checkpoint, None).await {
                    Ok(()) => {}
                    Err(e) => {
                        tracing::error!(job, checkpoint = %m.checkpoint, "cannot roll the migration back: {e}")
                    }
                }
            }
            let _ = self.set_migration(&job, None);
        }
    }

    /// Mark `node` drained (or not).
    fn set_drained(&self, node: &str, drained: bool) -> Result<NodeRecord, Error> {
        let was = self.is_drained(node);
        let r = self.catalog.update(|s| {
            let mut n = s
                .nodes
                .get(node)
                .cloned()
                .ok_or_else(|| Error::UnknownNode {
                    node: node.into(),
                    known: s
                        .nodes
                        .keys()
                        .take(10)
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", "),
                })?;
            n.drained = drained;
            Ok::<_, Error>((vec![Change::Node(n.clone())], n))
        });
        if r.is_ok() && was != drained {
            let phase = if drained { "drained" } else { "undrained" };
            self.events.node(node, phase, "");
        }
        r
    }

    /// `crctl undrain NODE`.
    pub fn undrain(&self, node: &str) -> Result<pb::NodeInfo, Error> {
        self.set_drained(node, false)?;
        tracing::info!(node, "undrained");
        self.nodes()
            .nodes
            .into_iter()
            .find(|n| n.name == node)
            .ok_or_else(|| Error::UnknownNode {
                node: node.into(),
                known: String::new(),
            })
    }

    /// `crctl drain NODE`: every job's members on it placed elsewhere
    /// ([`crate::placement`]; a member no node can hold refuses the drain,
    /// nothing moved, the node not drained), then the node drained and
    /// the members migrated off, job by job, within `deadline`. `reason`:
    /// who asked and why, when not an administrator (the node's own agent).
    pub async fn drain(
        &self,
        node: &str,
        deadline: Option<Duration>,
        reason: &str,
    ) -> Result<pb::DrainReply, Error> {
        let until = Instant::now() + deadline.unwrap_or(self.settings.timeout);
        if !self.catalog.read(|s| s.nodes.contains_key(node)) {
            // set_drained names the known nodes.
            self.set_drained(node, true)?;
        }
        let jobs: Vec<(String, Vec<i32>)> = self.catalog.read(|s| {
            s.jobs
                .values()
                .map(|j| {
                    (
                        j.name.clone(),
                        j.members
                            .iter()
                            .filter(|m| m.alive && m.node == node)
                            .map(|m| m.pid)
                            .collect::<Vec<_>>(),
                    )
                })
                .filter(|(_, p)| !p.is_empty())
                .collect()
        });
        let targets = self.drain_plan(node, &jobs)?;
        self.set_drained(node, true)?;
        tracing::info!(node, reason, "drained: moving its members off");
        let mut reply = pb::DrainReply {
            node: node.into(),
            ..Default::default()
        };
        self.events.drain_started(node, jobs.len() as u32, reason);
        let r = self
            .drain_jobs(node, jobs, targets, until, &mut reply)
            .await;
        self.events.drain_done(node);
        r.map(|()| reply)
    }

    /// Size in bytes of member `pid` of `job` on `node`: the larger of its
    /// resident memory at the agent's last report and its image's pages
    /// in the job's last committed checkpoint.
    fn member_bytes(
        &self,
        job: &str,
        node: &str,
        pid: i32,
        live: &crate::registry::Liveness,
    ) -> u64 {
        let image = self.catalog.read(|s| {
            s.checkpoints
                .get(job)
                .into_iter()
                .flat_map(|c| c.values().rev())
                .filter_map(|c| c.info.as_ref())
                .find(|i| i.state == "committed")
                .and_then(|i| {
                    i.images
                        .iter()
                        .find(|im| im.node == node && im.pid == pid)
                        .map(|im| im.page_bytes)
                })
                .unwrap_or(0)
        });
        live.rss(node, pid).max(image)
    }

    /// The target of each member of `jobs` on `node` (Slurm jobs left
    /// out), or why the drain is refused.
    ///
    /// Members connected over loopback must land on one node (their
    /// connection cannot be rewritten to another address), so a job's
    /// members on `node` are first placed as one bundle; when no node
    /// holds every bundle, as the groups its last committed checkpoint
    /// shows connected over loopback; only then is the drain refused.
    pub(crate) fn drain_plan(
        &self,
        node: &str,
        jobs: &[(String, Vec<i32>)],
    ) -> Result<HashMap<(String, i32), String>, Error> {
        use crate::placement::{place, Sized};
        let live = self.liveness();
        let nodes = self.candidates(&live, |n| n == node);
        let jobs: Vec<&(String, Vec<i32>)> = jobs.iter().filter(|(j, _)| !slurm_job(j)).collect();
        let sized = |groups: Vec<(String, Vec<i32>)>| -> Vec<Sized<(String, Vec<i32>)>> {
            groups
                .into_iter()
                .map(|(j, pids)| Sized {
                    bytes: pids
                        .iter()
                        .map(|&pid| self.member_bytes(&j, node, pid, &live))
                        .sum(),
                    key: (j, pids),
                })
                .collect()
        };
        let whole = sized(jobs.iter().map(|(j, p)| (j.clone(), p.clone())).collect());
        let placed = place(&nodes, &whole).or_else(|_| {
            let groups = jobs
                .iter()
                .flat_map(|(j, pids)| {
                    self.loopback_groups(j, node, pids)
                        .into_iter()
                        .map(move |g| (j.clone(), g))
                })
                .collect();
            place(&nodes, &sized(groups))
        });
        match placed {
            Ok(p) => Ok(p
                .into_iter()
                .flat_map(|((j, pids), to)| {
                    pids.into_iter()
                        .map(move |pid| ((j.clone(), pid), to.clone()))
                })
                .collect()),
            Err(e) => {
                let best = e.best_text();
                let (job, pids) = e.key;
                let member = pids
                    .iter()
                    .map(|p| format!("{node}:{p}"))
                    .collect::<Vec<_>>()
                    .join(" + ");
                tracing::warn!(node, job, member, bytes = e.bytes, "drain refused: no room");
                Err(Error::NoRoom {
                    node: node.into(),
                    member,
                    job,
                    mib: e.bytes.div_ceil(1 << 20),
                    best,
                })
            }
        }
    }

    /// `pids` (members of `job` on `node`) in groups connected over
    /// loopback, as the job's last committed checkpoint recorded their
    /// connections.
    fn loopback_groups(&self, job: &str, node: &str, pids: &[i32]) -> Vec<Vec<i32>> {
        let ck = self
            .catalog
            .read(|s| s.latest_committed(job).map(|c| c.info().clone()));
        loopback_groups(ck.as_ref(), node, pids)
    }

    /// The drain's migrations, job by job, each member to its target in
    /// `targets`; what happened to each goes into `reply`.
    async fn drain_jobs(
        &self,
        node: &str,
        jobs: Vec<(String, Vec<i32>)>,
        targets: HashMap<(String, i32), String>,
        until: Instant,
        reply: &mut pb::DrainReply,
    ) -> Result<(), Error> {
        for (job, pids) in jobs {
            if slurm_job(&job) {
                let why = "a Slurm job: Slurm moves it (checkpoint and requeue by cr-slurm-drain)";
                self.events.drain_job(node, &job, "left", why);
                reply.left.push(format!("{job}: {why}"));
                continue;
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let why = "the drain's deadline passed first";
                self.events.drain_job(node, &job, "failed", why);
                reply.failed.push(format!("{job}: {why}"));
                continue;
            }
            let moves: HashMap<(String, i32), String> = pids
                .iter()
                .filter_map(|&pid| {
                    let t = targets.get(&(job.clone(), pid))?;
                    Some(((node.to_string(), pid), t.clone()))
                })
                .collect();
            if moves.is_empty() {
                let why = "no other node is up and undrained";
                self.events.drain_job(node, &job, "failed", why);
                reply.failed.push(format!("{job}: {why}"));
                continue;
            }
            let mut to: Vec<String> = moves
                .iter()
                .map(|((n, p), t)| format!("{n}:{p} to {t}"))
                .collect();
            to.sort();
            self.events.drain_job(node, &job, "moving", &to.join(", "));
            match self
                .migrate_moves(&job, moves, Some(left), false, false)
                .await
            {
                Ok(r) => {
                    let what = format!("{} (down {} ms)", r.moved.join(", "), r.downtime_ms);
                    self.events.drain_job(node, &job, "moved", &what);
                    reply.migrations.push(r);
                }
                Err(e) => {
                    self.events.drain_job(node, &job, "failed", &e.to_string());
                    reply.failed.push(format!("{job}: {e}"));
                }
            }
        }
        tracing::info!(
            node,
            moved = reply.migrations.len(),
            failed = reply.failed.len(),
            "drain done"
        );
        Ok(())
    }
}

/// Whether `job` is a Slurm job's (`slurm-JOBID`, the name the SPANK plugin
/// gives it: `cr_spank::task::job_name`). A drain does not migrate it: its
/// batch step would see its task killed and Slurm would still count it on
/// the node; cr-slurm-drain moves it by checkpoint and requeue instead.
fn slurm_job(job: &str) -> bool {
    job.strip_prefix("slurm-")
        .is_some_and(|id| !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_jobs_are_left_to_slurm() {
        assert!(slurm_job("slurm-42"));
        for j in ["slurm-", "slurm-4x", "ring", "slurm-42-3", "myslurm-1"] {
            assert!(!slurm_job(j), "{j}");
        }
    }

    fn node(name: &str, ip: &str) -> (String, NodeRecord) {
        (
            name.to_string(),
            NodeRecord {
                name: name.into(),
                addresses: vec![ip.into()],
                ..Default::default()
            },
        )
    }

    fn bm(local: &str, remote: &str) -> pb::Bookmark {
        pb::Bookmark {
            local: local.into(),
            remote: remote.into(),
            ..Default::default()
        }
    }

    fn img(node: &str, pid: i32, marks: Vec<pb::Bookmark>) -> pb::ImageInfo {
        pb::ImageInfo {
            node: node.into(),
            pid,
            bookmarks: marks,
            ..Default::default()
        }
    }

    fn nodes() -> BTreeMap<String, NodeRecord> {
        [
            node("n1", "10.0.0.1"),
            node("n2", "10.0.0.2"),
            node("n3", "10.0.0.3"),
        ]
        .into_iter()
        .collect()
    }

    /// A (n1) talks to C (n1, by n1's address) and to B (n2); A moves to n3.
    fn ring() -> pb::CheckpointInfo {
        pb::CheckpointInfo {
            images: vec![
                img(
                    "n1",
                    10,
                    vec![
                        bm("10.0.0.1:7300", "10.0.0.1:5000"),
                        bm("10.0.0.1:6000", "10.0.0.2:7301"),
                    ],
                ),
                img("n2", 20, vec![bm("10.0.0.2:7301", "10.0.0.1:6000")]),
                img("n1", 30, vec![bm("10.0.0.1:5000", "10.0.0.1:7300")]),
            ],
            ..Default::default()
        }
    }

    #[test]
    fn a_moved_member_takes_its_endpoints_only() {
        let moves = [(("n1".to_string(), 10), "n3".to_string())]
            .into_iter()
            .collect();
        let p = plan("J", &ring(), &nodes(), &Placement::Members(moves)).unwrap();
        assert_eq!(p.dst, ["n3", "n2", "n1"]);
        assert_eq!(
            p.map_addr,
            ["10.0.0.1:6000=10.0.0.3", "10.0.0.1:7300=10.0.0.3"]
        );
        // It talks to C, which stays at 10.0.0.1: no rewrite of the whole
        // address in its image.
        assert!(p.own_map.iter().all(|m| m.is_empty()), "{:?}", p.own_map);
    }

    #[test]
    fn a_member_alone_on_its_node_takes_its_addresses() {
        let moves = [(("n2".to_string(), 20), "n3".to_string())]
            .into_iter()
            .collect();
        let p = plan("J", &ring(), &nodes(), &Placement::Members(moves)).unwrap();
        assert_eq!(p.dst, ["n1", "n3", "n1"]);
        assert_eq!(p.map_addr, ["10.0.0.2:7301=10.0.0.3"]);
        assert_eq!(p.own_map[1], ["10.0.0.2=10.0.0.3"]);
    }

    #[test]
    fn drain_groups_follow_loopback_connections() {
        let mut ck = ring();
        // A (10) and C (30) on n1 talk over loopback; 40 is a new member.
        ck.images[0].bookmarks[0] = bm("127.0.0.1:7300", "127.0.0.1:5000");
        ck.images[2].bookmarks[0] = bm("127.0.0.1:5000", "127.0.0.1:7300");
        assert_eq!(
            loopback_groups(Some(&ck), "n1", &[30, 40, 10]),
            [vec![30, 10], vec![40]]
        );
        // Over the node's address they may part; without a checkpoint too.
        assert_eq!(
            loopback_groups(Some(&ring()), "n1", &[10, 30]),
            [vec![10], vec![30]]
        );
        assert_eq!(loopback_groups(None, "n1", &[10]), [vec![10]]);
    }

    #[test]
    fn loopback_peers_move_together() {
        let mut ck = ring();
        ck.images[0].bookmarks[0] = bm("127.0.0.1:7300", "127.0.0.1:5000");
        ck.images[2].bookmarks[0] = bm("127.0.0.1:5000", "127.0.0.1:7300");
        let moves: HashMap<_, _> = [(("n1".to_string(), 10), "n3".to_string())]
            .into_iter()
            .collect();
        let e = plan("J", &ck, &nodes(), &Placement::Members(moves)).unwrap_err();
        assert!(e.contains("over loopback") && e.contains("n1:30"), "{e}");
        let both = [
            (("n1".to_string(), 10), "n3".to_string()),
            (("n1".to_string(), 30), "n3".to_string()),
        ]
        .into_iter()
        .collect();
        assert!(plan("J", &ck, &nodes(), &Placement::Members(both)).is_ok());
    }

    #[test]
    fn old_nodes_go_to_new_ones_in_host_list_order() {
        // A job of n9 (its batch node, first of its allocation) and n10,
        // resumed over n2,n3: n9 -> n2 (the new batch node), n10 -> n3.
        let ck = pb::CheckpointInfo {
            images: vec![img("n10", 20, vec![]), img("n9", 10, vec![])],
            ..Default::default()
        };
        let mut all = nodes();
        all.extend([node("n9", "10.0.0.9"), node("n10", "10.0.0.10")]);
        let on = vec!["n2".to_string(), "n3".to_string()];
        let p = plan("J", &ck, &all, &Placement::Nodes(on)).unwrap();
        assert_eq!(p.dst, ["n3", "n2"]);
    }

    #[test]
    fn whole_nodes_map_their_addresses() {
        let p = plan("J", &ring(), &nodes(), &Placement::Nodes(vec!["n3".into()])).unwrap();
        assert_eq!(p.dst, ["n3", "n3", "n3"]);
        assert_eq!(p.map_addr, ["10.0.0.1=10.0.0.3", "10.0.0.2=10.0.0.3"]);
    }
}
