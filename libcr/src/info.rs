//! What callbacks can learn about the checkpoint in progress and, after a
//! restart, about where the process now runs: the node's host name (the
//! checkpointer's and the restorer's: a job in a UTS namespace of its own
//! keeps its own name wherever it is restarted) and the IP addresses the
//! process sees are remembered when the process is frozen and compared
//! with the new ones after a restart.

use std::sync::{Arc, Mutex};

/// The checkpoint in progress.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckpointInfo {
    /// The image directory.
    pub dest: String,
}

/// The last restart.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RestartInfo {
    /// The image directory restored from.
    pub src: String,
    pub hostname_before: String,
    pub hostname_now: String,
    /// The node's IP addresses (not loopback) at the checkpoint and now.
    pub addresses_before: Vec<String>,
    pub addresses_now: Vec<String>,
}

impl RestartInfo {
    /// The host name differs.
    pub fn node_changed(&self) -> bool {
        self.hostname_before != self.hostname_now
    }

    /// The set of addresses differs.
    pub fn addresses_changed(&self) -> bool {
        self.addresses_before != self.addresses_now
    }
}

struct Node {
    hostname: String,
    addresses: Vec<String>,
}

static CHECKPOINT: Mutex<Option<Arc<CheckpointInfo>>> = Mutex::new(None);
static RESTART: Mutex<Option<Arc<RestartInfo>>> = Mutex::new(None);
static NODE: Mutex<Option<Node>> = Mutex::new(None);

/// Where the process runs: on the node `hostname` names (the
/// checkpointer's or restorer's; empty: the process's own host name).
fn node(hostname: &str) -> Node {
    let hostname = if hostname.is_empty() {
        cr_proto::coop::node_name()
    } else {
        hostname.to_string()
    };
    let mut addresses: Vec<String> = nix::ifaddrs::getifaddrs()
        .map(|it| {
            it.filter_map(|i| {
                let a = i.address?;
                let ip: std::net::IpAddr = if let Some(v4) = a.as_sockaddr_in() {
                    v4.ip().into()
                } else {
                    a.as_sockaddr_in6()?.ip().into()
                };
                (!ip.is_loopback()).then(|| ip.to_string())
            })
            .collect()
        })
        .unwrap_or_default();
    addresses.sort();
    addresses.dedup();
    Node {
        hostname,
        addresses,
    }
}

pub(crate) fn set_checkpoint(dest: &str) {
    *CHECKPOINT.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(CheckpointInfo {
        dest: dest.to_string(),
    }));
}

/// Just before the freeze, on node `hostname` (the checkpointer's).
pub(crate) fn remember_node(hostname: &str) {
    *NODE.lock().unwrap_or_else(|e| e.into_inner()) = Some(node(hostname));
}

/// Restored from image `src` on node `hostname` (the restorer's).
pub(crate) fn set_restarted(hostname: &str, src: &str) {
    let now = node(hostname);
    let before = NODE.lock().unwrap_or_else(|e| e.into_inner()).take();
    let before = before.unwrap_or(Node {
        hostname: String::new(),
        addresses: Vec::new(),
    });
    *RESTART.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(RestartInfo {
        src: src.to_string(),
        hostname_before: before.hostname,
        hostname_now: now.hostname,
        addresses_before: before.addresses,
        addresses_now: now.addresses,
    }));
}

/// The checkpoint in progress or last taken.
pub fn checkpoint_info() -> Option<Arc<CheckpointInfo>> {
    CHECKPOINT.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// The last restart, if the process was restarted.
pub fn restart_info() -> Option<Arc<RestartInfo>> {
    RESTART.lock().unwrap_or_else(|e| e.into_inner()).clone()
}
