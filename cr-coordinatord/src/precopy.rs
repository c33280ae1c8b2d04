//! Pre-copy: the members of a job pre-dumped while it runs, so that the
//! coordinated freeze that follows writes only what changed since.
//!
//! Each round pre-dumps every member at once (the agent's `PreDump`: the
//! member's tree is stopped only to list its mappings and reset its dirty
//! tracker, its pages are copied while it runs), incremental on the round
//! before (the first on the member's image in the job's previous
//! checkpoint when the job is incremental, else full); for a migration the
//! moved members' rounds are fetched by their targets too. Rounds repeat
//! while they shrink: they stop once a round writes less than
//! [`SMALL_ROUND`], writes no less than 3/4 of the round before (the job
//! dirties memory as fast as it is copied), after [`MAX_ROUNDS`], or at the
//! deadline. The checkpoint is then incremental on the last round.
//!
//! Pre-dumps live under `<images>/JOB/JOB-precopy-STAMP/rN/NODE-PID`. A
//! pre-dump cannot be restored by itself: it is kept only as a parent of a
//! committed image. When the pre-copy or its checkpoint fails, the newest
//! pre-dump of each member is removed (and, by the agent, every pre-dump
//! it was made on that nothing else needs, see `cr_image::chain::remove_unused`);
//! retention removing a committed image removes its pre-dumps the same way.

use crate::coordinator::{now_unix_ms, Busy, Coordinator};
use crate::protocol::{group_by_node, timed};
use cr_rpc::pb;
use futures_util::future::join_all;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Most pre-copy rounds.
pub const MAX_ROUNDS: u32 = 6;
/// A pre-copy round that writes less than this is the last one.
pub const SMALL_ROUND: u64 = 4 << 20;
/// Bound of the best-effort removal of pre-dumps.
const REMOVE_BOUND: Duration = Duration::from_secs(10);

/// A member of a job: (node, pid).
pub type MemberKey = (String, i32);

/// What the pre-copy rounds did.
#[derive(Default, Debug)]
pub struct PreCopy {
    /// Each member's last pre-dump (the parent of its image in the
    /// checkpoint).
    pub parents: HashMap<MemberKey, String>,
    /// The copies of the moved members' last pre-dumps: (target node,
    /// directory there).
    pub copies: HashMap<MemberKey, (String, String)>,
    pub rounds: u32,
    /// Bytes the pre-dumps wrote (pages changed since the round before).
    pub written: u64,
    /// Bytes copied to targets.
    pub fetched: u64,
    pub ms: u64,
}

/// What a pre-copy's rounds work on (see [`Coordinator::pre_copy`]).
#[derive(Clone, Copy)]
struct Rounds<'a> {
    job: &'a str,
    members: &'a [MemberKey],
    first_parents: &'a HashMap<MemberKey, String>,
    fetch_to: &'a HashMap<MemberKey, String>,
    deadline: Instant,
}

impl Coordinator {
    /// Pre-copy rounds of `members` of `job` (see the module doc), each
    /// member's first round incremental on `first_parents` (if named
    /// there); the moved members of `fetch_to` fetched by their target
    /// after each round. On failure the pre-dumps made are removed.
    pub(crate) async fn pre_copy(
        &self,
        busy: &Busy<'_>,
        job: &str,
        members: &[MemberKey],
        first_parents: &HashMap<MemberKey, String>,
        fetch_to: &HashMap<MemberKey, String>,
        deadline: Instant,
    ) -> Result<PreCopy, String> {
        let mut out = PreCopy::default();
        let what = Rounds {
            job,
            members,
            first_parents,
            fetch_to,
            deadline,
        };
        let r = self.pre_copy_rounds(busy, &what, &mut out).await;
        match r {
            Ok(()) => Ok(out),
            Err(e) => {
                tracing::warn!(job, "pre-copy failed: {e}; its pre-dumps are removed");
                self.remove_pre_dumps(job, &out).await;
                Err(e)
            }
        }
    }

    async fn pre_copy_rounds(
        &self,
        busy: &Busy<'_>,
        w: &Rounds<'_>,
        out: &mut PreCopy,
    ) -> Result<(), String> {
        let Rounds {
            job,
            members,
            first_parents,
            fetch_to,
            deadline,
        } = *w;
        let t0 = Instant::now();
        let stamp = now_unix_ms();
        let nodes = self.catalog.read(|s| s.nodes.clone());
        let mut last: Option<u64> = None;
        for round in 1..=MAX_ROUNDS {
            busy.phase(&format!("pre-copy round {round}"));
            let subdir = format!("{job}/{job}-precopy-{stamp}/r{round}");
            let dumps = join_all(members.iter().map(|k| {
                let req = pb::PreDumpRequest {
                    pid: k.1,
                    subdir: subdir.clone(),
                    parent: out
                        .parents
                        .get(k)
                        .or_else(|| first_parents.get(k))
                        .cloned()
                        .unwrap_or_default(),
                };
                async move {
                    let what = format!("PRE-DUMP of {}", k.1);
                    (
                        k,
                        timed(deadline, &what, &k.0, self.agents.pre_dump(&k.0, req))
                            .await
                            .1,
                    )
                }
            }))
            .await;
            let mut written = 0;
            let mut first_err = None;
            for (k, r) in dumps {
                match r {
                    Ok(r) => {
                        written += r.store_bytes;
                        out.parents.insert(k.clone(), r.dir);
                    }
                    Err(e) => {
                        first_err.get_or_insert(format!("node {}: {e}", k.0));
                    }
                }
            }
            if let Some(e) = first_err {
                return Err(e);
            }
            if !fetch_to.is_empty() {
                self.fetch_round(job, round, fetch_to, &nodes, deadline, out)
                    .await?;
            }
            out.rounds = round;
            out.written += written;
            tracing::info!(job, round, bytes = written, "pre-copy round done");
            self.events.pre_copy_round(job, round, written, out.fetched);
            let shrinking = last.is_none_or(|l| written * 4 < l * 3);
            last = Some(written);
            if written < SMALL_ROUND || !shrinking || Instant::now() >= deadline {
                break;
            }
        }
        out.ms = t0.elapsed().as_millis() as u64;
        Ok(())
    }

    /// The moved members' last pre-dumps fetched by their targets.
    async fn fetch_round(
        &self,
        job: &str,
        round: u32,
        fetch_to: &HashMap<MemberKey, String>,
        nodes: &std::collections::BTreeMap<String, crate::catalog::NodeRecord>,
        deadline: Instant,
        out: &mut PreCopy,
    ) -> Result<(), String> {
        let timeout_ms = deadline
            .saturating_duration_since(Instant::now())
            .as_millis()
            .min(u128::from(u32::MAX)) as u32;
        let fetches = join_all(fetch_to.iter().map(|(k, dst)| {
            let req = pb::FetchRequest {
                from_node: k.0.clone(),
                from_addr: nodes
                    .get(&k.0)
                    .map(|n| n.agent_addr.clone())
                    .unwrap_or_default(),
                dirs: out.parents.get(k).cloned().into_iter().collect(),
                what: format!("pre-copy round {round} of {job}"),
                timeout_ms,
                lazy: false,
                job: job.to_string(),
            };
            async move {
                let what = format!("FETCH from {}", k.0);
                (
                    k,
                    dst,
                    timed(deadline, &what, dst, self.agents.fetch(dst, req))
                        .await
                        .1,
                )
            }
        }))
        .await;
        let mut first_err = None;
        for (k, dst, r) in fetches {
            match r {
                Ok(r) => {
                    out.fetched += r.bytes;
                    if let Some(d) = r.dirs.into_iter().next() {
                        out.copies.insert(k.clone(), (dst.clone(), d));
                    }
                }
                Err(e) => {
                    first_err.get_or_insert(format!("node {dst}: {e}"));
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Best effort: the newest pre-dump of every member of `pre` removed on
    /// its node, and the copies on the targets (the agents remove the
    /// older rounds they were made on with them).
    pub(crate) async fn remove_pre_dumps(&self, job: &str, pre: &PreCopy) {
        let placed = pre
            .parents
            .iter()
            .map(|(k, d)| (k.0.clone(), d.clone()))
            .chain(pre.copies.values().cloned());
        let by_node = group_by_node(placed);
        if by_node.is_empty() {
            return;
        }
        let deadline = Instant::now() + REMOVE_BOUND;
        let calls = by_node.iter().map(|(n, dirs)| {
            let req = pb::RemoveRequest { dirs: dirs.clone() };
            timed(deadline, "REMOVE", n, self.agents.remove(n, req))
        });
        for (n, r) in join_all(calls).await {
            match r {
                Ok(_) => tracing::info!(job, node = %n, "pre-dumps removed"),
                Err(e) => tracing::warn!(job, node = %n, "cannot remove the pre-dumps: {e}"),
            }
        }
    }
}
