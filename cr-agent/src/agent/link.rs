//! The agent's link to the coordinator: register the node (address, IPs,
//! live members), then heartbeat with the members; register again whenever
//! the coordinator lost us (it restarted) or could not be reached. Without a
//! coordinator (a standalone node) only the members are kept current.

use super::Shared;
use cr_rpc::pb;
use cr_rpc::pb::coordinator_client::CoordinatorClient;
use cr_rpc::tls::Security;
use std::sync::Arc;
use std::time::Duration;
use tracing::{info, warn};

const RPC_TIMEOUT: Duration = Duration::from_secs(5);
/// Heartbeat periods without a reply of the coordinator after which the
/// sessions in progress are aborted: the coordinator that drives them is
/// gone (or cut off), and the processes must not stay frozen until the
/// sessions' freeze bound.
const LOST_AFTER: u32 = 3;

pub async fn run(shared: Arc<Shared>, sec: Security) {
    let cfg = &shared.config;
    let mut period = Duration::from_millis(cfg.heartbeat_ms);
    let Some(addr) = cfg.coordinator.clone() else {
        loop {
            shared.members.sweep();
            tokio::select! {
                _ = tokio::time::sleep(period) => {}
                _ = shared.wake.notified() => {}
            }
        }
    };
    let channel = match cr_rpc::channel::lazy(&addr, &sec, &cfg.coordinator_name, RPC_TIMEOUT) {
        Ok(c) => c,
        Err(e) => {
            warn!(error = %e, "no link to the coordinator");
            return;
        }
    };
    let _ = shared.coordinator.set(channel.clone());
    let mut client = CoordinatorClient::new(channel);
    let mut registered = false;
    let mut last_err: Option<String> = None;
    let mut last_ok = std::time::Instant::now();
    let mut lost = false;
    loop {
        // A heartbeat waits at most two periods (at least a second): a cut
        // link is noticed within LOST_AFTER periods, not after RPC_TIMEOUTs.
        let rpc_timeout = (period * 2).clamp(Duration::from_secs(1), RPC_TIMEOUT);
        shared.members.sweep();
        let (mut members, generation) = shared.members.snapshot();
        for m in &mut members {
            m.rss = cr_sys::capacity::tree_rss(m.pid);
        }
        let res = if registered {
            let mut req = tonic::Request::new(pb::HeartbeatRequest {
                node: cfg.node.clone(),
                members,
                generation,
                transfers: shared.transfers.snapshot(),
                capacity: capacity(cfg.node_cgroup.as_deref()),
            });
            req.set_timeout(rpc_timeout);
            client.heartbeat(req).await.map(|r| {
                let r = r.into_inner();
                set_drained(&shared, r.drained);
                // The coordinator stretches the period as nodes join.
                if r.heartbeat_ms > 0 && u64::from(r.heartbeat_ms) != period.as_millis() as u64 {
                    period = Duration::from_millis(u64::from(r.heartbeat_ms));
                    info!(
                        ms = r.heartbeat_ms,
                        "heartbeat period changed by the coordinator"
                    );
                }
                if r.register_again {
                    info!("the coordinator does not know this node: registering again");
                    registered = false;
                }
            })
        } else {
            let mut req = tonic::Request::new(pb::RegisterRequest {
                node: cfg.node.clone(),
                agent_addr: cfg.advertise.clone(),
                addresses: cfg.addresses.clone(),
                version: env!("CARGO_PKG_VERSION").to_string(),
                members,
                generation,
                capacity: capacity(cfg.node_cgroup.as_deref()),
            });
            req.set_timeout(RPC_TIMEOUT);
            client.register(req).await.map(|r| {
                let r = r.into_inner();
                set_drained(&shared, r.drained);
                let hb = r.heartbeat_ms;
                if hb > 0 {
                    period = Duration::from_millis(u64::from(hb));
                }
                info!(
                    coordinator = addr,
                    node = cfg.node,
                    "registered with the coordinator"
                );
                registered = true;
            })
        };
        match res {
            Ok(()) => {
                last_ok = std::time::Instant::now();
                lost = false;
                if last_err.take().is_some() {
                    info!(coordinator = addr, "the coordinator answers again");
                }
            }
            Err(s) => {
                registered = false;
                if !lost && last_ok.elapsed() >= period * LOST_AFTER {
                    lost = true;
                    for id in shared.sessions.ids() {
                        warn!(
                            session = id,
                            "the coordinator is unreachable: aborting the session"
                        );
                        let sh = shared.clone();
                        tokio::spawn(async move {
                            if let Err(e) = sh.sessions.let_go(&id).await {
                                warn!(session = id, error = e, "abort failed");
                            }
                        });
                    }
                }
                let msg = cr_rpc::status_line(&s);
                if last_err.as_deref() != Some(msg.as_str()) {
                    warn!(
                        coordinator = addr,
                        error = msg,
                        "cannot reach the coordinator; retrying"
                    );
                    last_err = Some(msg);
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(jittered(period, &cfg.node)) => {}
            _ = shared.wake.notified() => {}
        }
    }
}

/// `period` give or take 10 %: agents started together (a cluster booted
/// at once) do not heartbeat in step, as one burst per period.
fn jittered(period: Duration, node: &str) -> Duration {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let r = xxhash_rust::xxh3::xxh3_64_with_seed(node.as_bytes(), now);
    period.mul_f64(0.9 + 0.2 * (r as f64 / u64::MAX as f64))
}

/// What the node can take now (None, logged, if it cannot be read).
fn capacity(cgroup: Option<&std::path::Path>) -> Option<pb::NodeCapacity> {
    match cr_sys::capacity::read(cgroup) {
        Ok(c) => Some(pb::NodeCapacity {
            mem_free: c.mem_free,
            mem_source: c.mem_source,
            cpus: c.cpus,
            load: c.load,
        }),
        Err(e) => {
            tracing::debug!(error = %e, "cannot read the node's capacity");
            None
        }
    }
}

/// A client of the coordinator, over the link's channel (None: this node
/// has no coordinator; `what` names what needed it).
pub fn coordinator(
    shared: &Shared,
    what: &str,
) -> Result<CoordinatorClient<tonic::transport::Channel>, tonic::Status> {
    shared
        .coordinator
        .get()
        .cloned()
        .map(CoordinatorClient::new)
        .ok_or_else(|| {
            tonic::Status::failed_precondition(format!(
                "this node has no coordinator: {what} needs a cluster (cr-agent --coordinator)"
            ))
        })
}

/// A coordinator's answer as the local client's: its code, one line.
pub fn relay<T>(r: Result<tonic::Response<T>, tonic::Status>) -> Result<T, tonic::Status> {
    r.map(|r| r.into_inner())
        .map_err(|s| tonic::Status::new(s.code(), cr_rpc::status_line(&s)))
}

/// Record the coordinator's word on whether the node is drained.
fn set_drained(shared: &Shared, drained: bool) {
    let was = shared
        .drained
        .swap(drained, std::sync::atomic::Ordering::Relaxed);
    if was != drained {
        info!(drained, "the coordinator changed the node's drain state");
    }
}
