//! Periodic checkpoints: every second, each job with `interval_secs > 0`
//! whose last checkpoint (committed or attempted) started longer ago than
//! its interval, which is running (every member alive on a node that is up)
//! and not busy, gets a CONTINUE checkpoint. Nodes that stop heartbeating
//! are also logged here, once per outage.

use crate::catalog::State;
use crate::coordinator::{now_unix_ms, Coordinator};
use crate::error::Error;
use crate::registry::Liveness;
use cr_rpc::pb;
use std::sync::Arc;
use std::time::Duration;

/// How often the schedule is looked at.
pub const TICK: Duration = Duration::from_secs(1);

/// The jobs due for a periodic checkpoint now.
fn due(s: &State, live: &Liveness, now_ms: u64, busy: impl Fn(&str) -> bool) -> Vec<String> {
    s.jobs
        .values()
        .filter(|j| j.interval_secs > 0)
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

/// Run the schedule until the coordinator stops.
pub async fn run(coord: Arc<Coordinator>) {
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = coord.stopped() => return,
        }
        for n in coord.registry.newly_down(coord.settings.node_timeout) {
            tracing::warn!(node = %n, "node is down (no heartbeat)");
        }
        let live = coord.liveness();
        let jobs = coord
            .catalog
            .read(|s| due(s, &live, now_unix_ms(), |j| coord.is_busy(j)));
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
