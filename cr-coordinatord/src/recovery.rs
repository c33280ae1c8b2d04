//! Uncoordinated checkpoints and the recovery line (docs/PROTOCOLS.md).
//!
//! A job in mode `uncoordinated` has each member checkpointed on its own
//! schedule (its interval with a per-member jitter), frozen alone while the
//! others run on: one image per checkpoint, scope `member`. The job's
//! history is every committed checkpoint taken since its last restart,
//! member checkpoints and whole-job ones alike, each image one point of its
//! member's history; [`cr_image::recovery`] finds the latest consistent cut
//! of it from the images' TCP bookmarks. A restart with `--line` restores
//! each member from its checkpoint on that line; checkpoints wholly behind
//! the line are garbage and retention removes them.

use crate::catalog::{state, CheckpointRecord, JobRecord, State};
use crate::coordinator::Coordinator;
use crate::error::Error;
use crate::protocol::scoped_addr;
use cr_image::bookmarks::Bookmark;
use cr_image::recovery::{recovery_line, Line};
use cr_rpc::pb;
use std::collections::HashSet;
use std::net::SocketAddr;

/// One point of a member's history: a checkpoint and its image of the
/// member.
#[derive(Debug, Clone)]
pub struct Point {
    pub checkpoint: String,
    pub taken_unix_ms: u64,
    pub image: pb::ImageInfo,
}

/// A job's history since its last restart: per member (in the order of the
/// job's members), its points oldest first.
#[derive(Debug, Clone)]
pub struct History {
    pub job: JobRecord,
    pub points: Vec<Vec<Point>>,
    /// The committed checkpoints the history was built from.
    pub checkpoints: Vec<CheckpointRecord>,
    /// The addresses of the nodes its members are on: a connection to
    /// anything else leads outside the job.
    pub member_ips: HashSet<String>,
}

impl History {
    /// The history of `job` in the catalog state `s`.
    pub fn of(s: &State, job: &str) -> Result<History, Error> {
        let jobrec = s
            .jobs
            .get(job)
            .cloned()
            .ok_or_else(|| Error::UnknownJob { job: job.into() })?;
        let mut points = vec![Vec::new(); jobrec.members.len()];
        let mut checkpoints = Vec::new();
        for c in s.job_checkpoints(job).filter(|c| {
            c.state() == state::COMMITTED && c.info().started_unix_ms >= jobrec.restarted_unix_ms
        }) {
            for img in &c.info().images {
                let Some(m) = jobrec
                    .members
                    .iter()
                    .position(|m| m.node == img.node && m.pid == img.pid)
                else {
                    continue;
                };
                points[m].push(Point {
                    checkpoint: c.id().to_string(),
                    taken_unix_ms: c.info().started_unix_ms,
                    image: img.clone(),
                });
            }
            checkpoints.push(c.clone());
        }
        let member_ips = jobrec
            .members
            .iter()
            .filter_map(|m| s.nodes.get(&m.node))
            .flat_map(|n| n.addresses.iter().cloned())
            .collect();
        Ok(History {
            job: jobrec,
            points,
            checkpoints,
            member_ips,
        })
    }

    /// The bookmarks of every point, addresses scoped by node (loopback
    /// addresses of two nodes are not one address).
    fn bookmarks(&self) -> Vec<Vec<Vec<Bookmark>>> {
        self.points
            .iter()
            .map(|ps| {
                ps.iter()
                    .map(|p| {
                        p.image
                            .bookmarks
                            .iter()
                            .map(|b| Bookmark {
                                local: scoped_addr(&p.image.node, &b.local),
                                remote: scoped_addr(&p.image.node, &b.remote),
                                snd_una: b.snd_una,
                                snd_nxt: b.snd_nxt,
                                rcv_nxt: b.rcv_nxt,
                                write_seq: b.write_seq,
                            })
                            .collect()
                    })
                    .collect()
            })
            .collect()
    }

    /// Its recovery line.
    pub fn line(&self) -> Line {
        recovery_line(&self.bookmarks())
    }

    /// Whether `remote` (a bookmark's address, scoped) is no address of a
    /// node of the job (a loopback address may be a member's: not outside).
    fn outside(&self, remote: &str) -> bool {
        remote
            .parse::<SocketAddr>()
            .is_ok_and(|a| !a.ip().is_loopback() && !self.member_ips.contains(&a.ip().to_string()))
    }

    /// The checkpoints wholly behind `line`: every image of a current
    /// member in them lies before that member's point on the line. None
    /// while a connection end whose peer may be a member is unpaired: the
    /// line may still move back then (`cr_image::recovery`, Garbage).
    pub fn garbage(&self, line: &Line) -> Vec<&CheckpointRecord> {
        if line.unpaired.iter().any(|(_, _, r)| !self.outside(r)) {
            return Vec::new();
        }
        self.checkpoints
            .iter()
            .filter(|c| {
                let mut any = false;
                let all_behind = self.points.iter().enumerate().all(|(m, ps)| {
                    ps.iter()
                        .enumerate()
                        .filter(|(_, p)| p.checkpoint == c.id())
                        .all(|(k, _)| {
                            any = true;
                            line.behind(m, k)
                        })
                });
                any && all_behind
            })
            .collect()
    }

    /// The line as the RecoveryLine call answers it.
    pub fn reply(&self, line: &Line) -> pb::RecoveryLineReply {
        let members = self
            .job
            .members
            .iter()
            .zip(&self.points)
            .enumerate()
            .map(|(m, (rec, ps))| {
                let on = line.cut[m].map(|k| &ps[k]);
                pb::LineMember {
                    node: rec.node.clone(),
                    pid: rec.pid,
                    command: rec.command.clone(),
                    checkpoint: on.map(|p| p.checkpoint.clone()).unwrap_or_default(),
                    dir: on.map(|p| p.image.dir.clone()).unwrap_or_default(),
                    taken_unix_ms: on.map_or(0, |p| p.taken_unix_ms),
                    rolled_back: line.rolled_back[m] as u32,
                    checkpoints: ps.len() as u32,
                }
            })
            .collect();
        let unmatched = line
            .unmatched
            .iter()
            .map(|(m, l, r)| {
                let rec = &self.job.members[*m];
                format!("{}:{} {l} -> {r}", rec.node, rec.pid)
            })
            .collect();
        pb::RecoveryLineReply {
            job: self.job.name.clone(),
            members,
            at_start: line.at_start(),
            unmatched,
            garbage: self
                .garbage(line)
                .iter()
                .map(|c| c.id().to_string())
                .collect(),
        }
    }

    /// A checkpoint made of the images on `line`, for a restart: refused
    /// when a member has no checkpoint on it (it would start over while
    /// the others resume).
    pub fn line_checkpoint(&self, line: &Line) -> Result<CheckpointRecord, Error> {
        let job = &self.job.name;
        if self.points.is_empty() {
            return Err(Error::NoCheckpoint { job: job.clone() });
        }
        let mut images = Vec::new();
        let mut ids = Vec::new();
        for (m, rec) in self.job.members.iter().enumerate() {
            let Some(k) = line.cut[m] else {
                return Err(Error::Invalid {
                    what: format!(
                        "job {job}: member {}:{} ({}) has no checkpoint on the recovery line{}; restart the job from the start",
                        rec.node,
                        rec.pid,
                        rec.command,
                        if self.points[m].is_empty() { " (it has none)" } else { " (the line rolls it back to its start)" }
                    ),
                });
            };
            let p = &self.points[m][k];
            images.push(p.image.clone());
            if !ids.contains(&p.checkpoint) {
                ids.push(p.checkpoint.clone());
            }
        }
        let newest = self
            .checkpoints
            .iter()
            .rfind(|c| ids.iter().any(|i| i == c.id()))
            .cloned()
            .ok_or_else(|| Error::NoCheckpoint { job: job.clone() })?;
        let mut rec = newest;
        let info = rec.info_mut();
        // Not a checkpoint of the catalog: nothing is recorded under it
        // (copies fetched for the restart are not replicas of one of them).
        info.id = format!("{job}-line");
        info.images = images;
        info.scope = String::new();
        info.notes = vec![format!("recovery line of {}", ids.join(", "))];
        Ok(rec)
    }
}

impl Coordinator {
    /// The recovery line of `job`.
    pub fn recovery_line(&self, job: &str) -> Result<pb::RecoveryLineReply, Error> {
        let h = self.catalog.read(|s| History::of(s, job))?;
        Ok(h.reply(&h.line()))
    }
}

/// Member `key`'s interval in an uncoordinated job: the job's interval
/// spread by up to +-25 % so that members do not all freeze together,
/// fixed per member (a hash of its node and PID).
pub fn jittered_ms(interval_secs: u32, node: &str, pid: i32) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in node.bytes().chain(pid.to_le_bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    let base = u64::from(interval_secs) * 1000;
    // In [-25 %, +25 %] of the interval.
    let spread = base / 2;
    base - base / 4 + h % (spread + 1)
}
