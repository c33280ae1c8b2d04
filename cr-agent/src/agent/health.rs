//! Draining this node from the node itself: its health check
//! (`health_check`, run every `health_interval`; after `health_failures`
//! failures in a row the agent asks the coordinator to drain the node,
//! saying why), and `crctl drain --self` (`Local.DrainNode`, root only).
//! The coordinator takes a drain of node N from N's own certificate
//! (`DrainRequest.from_node`), for N only.
//!
//! A check fails when its command exits non-zero, is killed, or runs past
//! the interval (it is then killed). Once the node is drained no drain is
//! asked again until `crctl undrain` lifts it; a check that passes again
//! undrains nothing (an operator does, once the node is fixed).

use super::Shared;
use cr_rpc::pb;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tracing::{info, warn};

/// Most bytes of a failing check's output kept for its log line and the
/// drain's reason.
const OUTPUT_KEPT: usize = 200;

/// What the health check is: `command` (run by `/bin/sh -c`) every
/// `interval`, the node drained after `failures` failures in a row.
#[derive(Debug, Clone)]
pub struct HealthCheck {
    pub command: String,
    pub interval: Duration,
    pub failures: u32,
}

/// Ask the coordinator to drain this node (`reason`: why, for its log and
/// the watchers); its reply once the drain is over.
pub async fn drain_self(
    shared: &Shared,
    reason: &str,
    deadline_secs: u32,
) -> Result<pb::DrainReply, tonic::Status> {
    let node = shared.config.node.clone();
    let mut client = super::link::coordinator(shared, "draining this node")?;
    let mut q = tonic::Request::new(pb::DrainRequest {
        node: node.clone(),
        deadline_secs,
        from_node: node.clone(),
        reason: reason.to_string(),
    });
    // The coordinator's own deadline (default 120 s) bounds the moves;
    // rolling one back may take as long again.
    let secs = if deadline_secs == 0 {
        120
    } else {
        u64::from(deadline_secs)
    };
    q.set_timeout(Duration::from_secs(2 * secs + 30));
    info!(node, reason, "asking the coordinator to drain this node");
    let r = super::link::relay(client.drain(q).await)?;
    // Known at once, not only with the next heartbeat.
    shared.drained.store(true, Ordering::Relaxed);
    info!(
        node,
        moved = r.migrations.len(),
        failed = ?r.failed,
        left = ?r.left,
        "this node is drained"
    );
    Ok(r)
}

/// One run of the check: None when it passed, else why it failed.
async fn check_once(h: &HealthCheck) -> Option<String> {
    let child = tokio::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(&h.command)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn();
    let child = match child {
        Ok(c) => c,
        Err(e) => return Some(format!("cannot run /bin/sh: {e}")),
    };
    match tokio::time::timeout(h.interval, child.wait_with_output()).await {
        Err(_) => Some(format!(
            "it ran longer than {:.1} s (killed)",
            h.interval.as_secs_f64()
        )),
        Ok(Err(e)) => Some(format!("cannot wait for it: {e}")),
        Ok(Ok(out)) if out.status.success() => None,
        Ok(Ok(out)) => {
            let mut text = String::from_utf8_lossy(&out.stderr).trim().to_string();
            if text.is_empty() {
                text = String::from_utf8_lossy(&out.stdout).trim().to_string();
            }
            if text.len() > OUTPUT_KEPT {
                let mut cut = OUTPUT_KEPT;
                while !text.is_char_boundary(cut) {
                    cut -= 1;
                }
                text.truncate(cut);
                text.push_str("...");
            }
            let status = match out.status.code() {
                Some(c) => format!("exit status {c}"),
                None => "killed by a signal".to_string(),
            };
            Some(if text.is_empty() {
                status
            } else {
                format!("{status}: {}", text.replace('\n', " / "))
            })
        }
    }
}

/// Run the health check until the agent stops (see the module doc).
pub async fn run(shared: Arc<Shared>, h: HealthCheck) {
    info!(
        command = h.command,
        interval_s = h.interval.as_secs_f64(),
        failures = h.failures,
        "health check on"
    );
    let mut failed = 0u32;
    let mut tick = tokio::time::interval(h.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match check_once(&h).await {
            None => {
                if failed > 0 {
                    info!(after = failed, "health check passes again");
                }
                failed = 0;
            }
            Some(why) => {
                failed += 1;
                warn!(
                    command = h.command,
                    failures = failed,
                    of = h.failures,
                    "health check failed: {why}"
                );
                if failed < h.failures || shared.drained.load(Ordering::Relaxed) {
                    continue;
                }
                let reason = format!(
                    "health check `{}` failed {failed} times in a row, last: {why}",
                    h.command
                );
                warn!("{reason}: draining this node");
                if let Err(s) = drain_self(&shared, &reason, 0).await {
                    warn!(
                        error = s.message(),
                        "the drain of this node failed; asked again after the next failure"
                    );
                }
            }
        }
    }
}
