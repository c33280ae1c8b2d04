//! The agent's configuration: a TOML file (default `/etc/cr/agent.toml`)
//! under command-line flags. Keys are documented in docs/CLUSTER.md.

use super::health::HealthCheck;
use cr_rpc::tls::TlsFiles;
use cr_rpc::RpcError;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::PathBuf;

/// Default lease of a session's network locks.
pub const DEFAULT_LOCK_LEASE_MS: u64 = 4000;

/// The file as written; every key optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub node: Option<String>,
    pub listen: Option<String>,
    pub advertise: Option<String>,
    pub socket: Option<PathBuf>,
    pub coordinator: Option<String>,
    pub coordinator_name: Option<String>,
    pub images: Option<PathBuf>,
    pub state_dir: Option<PathBuf>,
    pub addresses: Option<Vec<String>>,
    pub heartbeat_ms: Option<u64>,
    pub lock_lease_ms: Option<u64>,
    pub health_check: Option<String>,
    pub health_interval_secs: Option<f64>,
    pub health_failures: Option<u32>,
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub insecure: Option<bool>,
    pub node_cgroup: Option<PathBuf>,
}

/// Everything resolved.
#[derive(Debug, Clone)]
pub struct Config {
    pub node: String,
    pub listen: SocketAddr,
    /// host:port the coordinator dials.
    pub advertise: String,
    pub socket: PathBuf,
    /// None: a standalone node (local clients only).
    pub coordinator: Option<String>,
    pub coordinator_name: String,
    pub images: PathBuf,
    pub state_dir: PathBuf,
    pub addresses: Vec<String>,
    pub heartbeat_ms: u64,
    /// Lease of a session's network locks: they lift by themselves this
    /// long after the agent stopped renewing them (it died).
    pub lock_lease_ms: u64,
    /// Drain the node when this check fails (see [`super::health`]).
    pub health: Option<HealthCheck>,
    pub tls: TlsFiles,
    /// The node's cgroup v2 directory whose limits lower the capacity
    /// reported (None: the agent's own cgroup; see `cr_sys::capacity`).
    pub node_cgroup: Option<PathBuf>,
}

/// Default of `health_interval_secs`.
pub const DEFAULT_HEALTH_INTERVAL_SECS: f64 = 30.0;
/// Default of `health_failures`.
pub const DEFAULT_HEALTH_FAILURES: u32 = 3;

fn bad(what: String) -> RpcError {
    RpcError::Config {
        path: PathBuf::from("cr-agent"),
        what,
    }
}

impl Config {
    /// Resolve `file` (already merged with the flags) into a configuration.
    pub fn resolve(f: FileConfig) -> Result<Config, RpcError> {
        let node = match f.node {
            Some(n) => n,
            None => cr_sys::proc::read_string("/proc/sys/kernel/hostname")
                .map(|s| s.trim().to_string())
                .unwrap_or_else(|_| "localhost".into()),
        };
        if node.is_empty() || node.contains(['/', ' ']) {
            return Err(bad(format!("bad node name {node:?}")));
        }
        let listen_s = f
            .listen
            .unwrap_or_else(|| format!("0.0.0.0:{}", cr_rpc::AGENT_PORT));
        let listen: SocketAddr = listen_s.parse().map_err(|_| RpcError::Address {
            addr: listen_s.clone(),
            what: "expected IP:PORT".into(),
        })?;
        let advertise = match f.advertise {
            Some(a) => a,
            None if f.coordinator.is_some() && listen.ip().is_unspecified() => {
                return Err(bad(format!(
                    "listen = {listen} is not an address the coordinator can dial; set advertise = \"IP:PORT\""
                )))
            }
            None => listen.to_string(),
        };
        let addresses = match f.addresses {
            Some(a) => a,
            None => advertise
                .parse::<SocketAddr>()
                .map(|a| vec![a.ip().to_string()])
                .unwrap_or_default(),
        };
        for a in &addresses {
            a.parse::<std::net::IpAddr>()
                .map_err(|_| RpcError::Address {
                    addr: a.clone(),
                    what: "expected an IP address".into(),
                })?;
        }
        let health = match f.health_check.filter(|c| !c.trim().is_empty()) {
            None => None,
            Some(command) => {
                let secs = f
                    .health_interval_secs
                    .unwrap_or(DEFAULT_HEALTH_INTERVAL_SECS);
                if !(secs.is_finite() && (0.05..=86400.0).contains(&secs)) {
                    return Err(bad(format!(
                        "health_interval_secs = {secs}: expected 0.05 to 86400 seconds"
                    )));
                }
                let failures = f.health_failures.unwrap_or(DEFAULT_HEALTH_FAILURES);
                if failures == 0 {
                    return Err(bad("health_failures = 0: expected at least 1".into()));
                }
                Some(HealthCheck {
                    command,
                    interval: std::time::Duration::from_secs_f64(secs),
                    failures,
                })
            }
        };
        if let Some(d) = &f.node_cgroup {
            if !d.join("cgroup.procs").exists() {
                return Err(bad(format!(
                    "node_cgroup = {}: not a cgroup v2 directory",
                    d.display()
                )));
            }
        }
        Ok(Config {
            node_cgroup: f.node_cgroup,
            health,
            node,
            listen,
            advertise,
            socket: f
                .socket
                .unwrap_or_else(|| PathBuf::from(cr_rpc::AGENT_SOCKET)),
            coordinator: f.coordinator,
            coordinator_name: f
                .coordinator_name
                .unwrap_or_else(|| cr_rpc::COORDINATOR_NAME.into()),
            images: f
                .images
                .unwrap_or_else(|| PathBuf::from("/var/lib/cr/images")),
            state_dir: f
                .state_dir
                .unwrap_or_else(|| PathBuf::from("/run/cr/agent")),
            addresses,
            heartbeat_ms: f.heartbeat_ms.unwrap_or(1000).max(50),
            lock_lease_ms: f.lock_lease_ms.unwrap_or(DEFAULT_LOCK_LEASE_MS).max(400),
            tls: TlsFiles {
                ca: f.ca,
                cert: f.cert,
                key: f.key,
                insecure: f.insecure.unwrap_or(false),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_health(cmd: Option<&str>, secs: Option<f64>, failures: Option<u32>) -> FileConfig {
        FileConfig {
            node: Some("n1".into()),
            health_check: cmd.map(String::from),
            health_interval_secs: secs,
            health_failures: failures,
            ..Default::default()
        }
    }

    #[test]
    fn health_check_keys() {
        let h = Config::resolve(with_health(Some("true"), None, None))
            .unwrap()
            .health
            .unwrap();
        assert_eq!(h.interval, std::time::Duration::from_secs(30));
        assert_eq!(h.failures, DEFAULT_HEALTH_FAILURES);
        let h = Config::resolve(with_health(Some("test -w /x"), Some(0.2), Some(2)))
            .unwrap()
            .health
            .unwrap();
        assert_eq!(
            (h.command.as_str(), h.interval.as_millis(), h.failures),
            ("test -w /x", 200, 2)
        );
        // No command: no check, whatever the other keys say.
        for cmd in [None, Some("  ")] {
            let c = Config::resolve(with_health(cmd, Some(1.0), Some(1))).unwrap();
            assert!(c.health.is_none());
        }
        for (secs, n, key) in [
            (Some(0.0), None, "health_interval_secs"),
            (Some(f64::NAN), None, "health_interval_secs"),
            (None, Some(0), "health_failures"),
        ] {
            let e = Config::resolve(with_health(Some("true"), secs, n)).unwrap_err();
            assert!(e.to_string().contains(key), "{e}");
        }
    }
}
