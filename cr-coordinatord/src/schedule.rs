//! Periodic checkpoints: every second, each job with `interval_secs > 0`
//! whose last checkpoint (committed or attempted) started longer ago than
//! its interval, which is running (every member alive on a node that is up)
//! and not busy, gets a CONTINUE checkpoint. An uncoordinated job instead
//! gets its members' own checkpoints, each member on its interval spread by
//! a fixed jitter ([`crate::recovery::jittered_ms`]), the most overdue
//! member first, one at a time. Nodes that stop heartbeating are also
//! logged (and told to the watchers) here, once per outage.

use crate::catalog::State;
use crate::coordinator::{now_unix_ms, Coordinator};
use crate::error::Error;
use crate::registry::Liveness;
use cr_rpc::pb;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often the schedule is looked at.
pub const TICK: Duration = Duration::from_secs(1);

/// When each member of an uncoordinated job was last tried (job, node,
/// pid): also the attempts that failed and left no image.
type Tried = HashMap<(String, String, i32), u64>;

/// The members of uncoordinated jobs due for their own checkpoint now:
/// per job, the most overdue one.
fn members_due(
    s: &State,
    live: &Liveness,
    now_ms: u64,
    tried: &Tried,
    busy: impl Fn(&str) -> bool,
) -> Vec<(String, String, i32)> {
    let mut out = Vec::new();
    for j in s.jobs.values() {
        if j.interval_secs == 0 || !j.uncoordinated() || busy(&j.name) {
            continue;
        }
        let overdue = j
            .members
            .iter()
            .filter(|m| m.alive && live.is_up(&m.node))
            .filter_map(|m| {
                let last_image = s
                    .job_checkpoints(&j.name)
                    .rev()
                    .find(|c| {
                        c.info().scope.is_empty()
                            || c.info()
                                .images
                                .iter()
                                .any(|i| i.node == m.node && i.pid == m.pid)
                    })
                    .map_or(0, |c| c.info().started_unix_ms);
                let key = (j.name.clone(), m.node.clone(), m.pid);
                let last = last_image.max(tried.get(&key).copied().unwrap_or(0));
                let every = crate::recovery::jittered_ms(j.interval_secs, &m.node, m.pid);
                let late = now_ms.saturating_sub(last);
                (late >= every).then(|| (late - every, m))
            })
            .max_by_key(|(late, _)| *late);
        if let Some((_, m)) = overdue {
            out.push((j.name.clone(), m.node.clone(), m.pid));
        }
    }
    out
}

/// The jobs due for a periodic checkpoint now.
fn due(s: &State, live: &Liveness, now_ms: u64, busy: impl Fn(&str) -> bool) -> Vec<String> {
    s.jobs
        .values()
        .filter(|j| j.interval_secs > 0 && !j.uncoordinated())
        .filter(|j| {
            !j.members.is_empty() && j.members.iter().all(|m| m.alive && live.is_up(&m.node))
        })
        .filter(|j| {
            let last = s
                .job_checkpoints(&j.name)
                .next_back()
                .map_or(0, |c| c.info().started_unix_ms);
            now_ms.saturating_sub(last) >= u64::from(j.interval_secs) * 1000
        })
        .filter(|j| !busy(&j.name))
        .map(|j| j.name.clone())
        .collect()
}

/// The members' last tries, even after a panic elsewhere while it was
/// held (it holds nothing that a half-done update could break).
fn locked(tried: &Mutex<Tried>) -> std::sync::MutexGuard<'_, Tried> {
    tried.lock().unwrap_or_else(|p| p.into_inner())
}

/// Run the schedule until the coordinator stops; a panic in it (a bug) is
/// logged and the schedule starts again after a tick, instead of periodic
/// checkpoints silently ending.
pub async fn supervise(coord: Arc<Coordinator>) {
    loop {
        match tokio::spawn(run(coord.clone())).await {
            Err(e) if e.is_panic() && !coord.is_stopping() => {
                tracing::error!("the checkpoint schedule panicked: starting it again");
                tokio::select! {
                    _ = tokio::time::sleep(TICK) => {}
                    _ = coord.stopped() => return,
                }
            }
            _ => return,
        }
    }
}

/// Run the schedule until the coordinator stops.
async fn run(coord: Arc<Coordinator>) {
    let mut tick = tokio::time::interval(TICK);
    let tried = Arc::new(Mutex::new(Tried::new()));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = coord.stopped() => return,
        }
        for n in coord.registry.newly_down() {
            tracing::warn!(node = %n, "node is down (no heartbeat)");
            let why = coord.liveness().down_reason(&n);
            coord.events.node(&n, "down", &why);
        }
        let live = coord.liveness();
        let now = now_unix_ms();
        let (jobs, members) = coord.catalog.read(|s| {
            (
                due(s, &live, now, |j| coord.is_busy(j)),
                members_due(s, &live, now, &locked(&tried), |j| coord.is_busy(j)),
            )
        });
        for (job, node, pid) in members {
            let c = coord.clone();
            let tried = tried.clone();
            // Member after member while they are due, not one per tick: a
            // member's own interval is kept however many members there are.
            tokio::spawn(async move {
                let mut next = Some((node, pid));
                while let Some((node, pid)) = next.take() {
                    locked(&tried).insert((job.clone(), node.clone(), pid), now_unix_ms());
                    tracing::info!(job = %job, node = %node, pid, "member checkpoint");
                    match c.checkpoint_member(&job, &node, pid).await {
                        Ok(info) => {
                            tracing::info!(job = %job, checkpoint = %info.id, node = %node, pid, "member checkpoint committed")
                        }
                        Err(e @ Error::Busy { .. }) => tracing::debug!(job = %job, "{e}"),
                        Err(e) => {
                            tracing::warn!(job = %job, node = %node, pid, "member checkpoint: {e}")
                        }
                    }
                    if c.is_stopping() {
                        return;
                    }
                    let live = c.liveness();
                    let t = locked(&tried).clone();
                    next = c
                        .catalog
                        .read(|s| {
                            members_due(s, &live, now_unix_ms(), &t, |j| j != job || c.is_busy(j))
                        })
                        .into_iter()
                        .next()
                        .map(|(_, n, p)| (n, p));
                }
            });
        }
        for job in jobs {
            let c = coord.clone();
            tokio::spawn(async move {
                tracing::info!(job = %job, "periodic checkpoint");
                match c.checkpoint(&job, pb::After::Continue, None).await {
                    Ok(info) => {
                        tracing::info!(job = %job, checkpoint = %info.id, "periodic checkpoint committed")
                    }
                    Err(e @ Error::Busy { .. }) => tracing::debug!(job = %job, "{e}"),
                    Err(e) => tracing::warn!(job = %job, "periodic checkpoint: {e}"),
                }
            });
        }
    }
}
