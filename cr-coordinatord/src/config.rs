//! The coordinator's configuration: the TOML file (`/etc/cr/coordinatord.toml`
//! unless `--config` names another) merged with the command-line flags,
//! which win. Keys and defaults are those of docs/CLUSTER.md.

use clap::Parser;
use cr_rpc::tls::TlsFiles;
use cr_rpc::RpcError;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// The config file read when `--config` is not given (a missing one is fine).
pub const DEFAULT_CONFIG: &str = "/etc/cr/coordinatord.toml";
/// Where the catalog lives unless configured otherwise.
pub const DEFAULT_DB: &str = "/var/lib/cr/coordinator.redb";

/// What is wrong with the configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Rpc(#[from] RpcError),
    #[error("bad listen address {addr:?}: {what}")]
    Listen { addr: String, what: String },
    #[error("{key} = {value}: {what}")]
    Invalid {
        key: &'static str,
        value: String,
        what: &'static str,
    },
}

/// `cr-coordinatord` command line.
#[derive(Debug, Clone, Default, Parser)]
#[command(
    name = "cr-coordinatord",
    version,
    about = "Coordinator of multi-node checkpoint/restart jobs"
)]
pub struct Args {
    /// Config file (TOML); required only when given explicitly.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Address of the Coordinator service.
    #[arg(long, value_name = "ADDR:PORT")]
    pub listen: Option<String>,
    /// The catalog (redb file).
    #[arg(long, value_name = "FILE")]
    pub db: Option<PathBuf>,
    /// The cluster CA's certificate.
    #[arg(long, value_name = "FILE")]
    pub ca: Option<PathBuf>,
    /// This coordinator's certificate.
    #[arg(long, value_name = "FILE")]
    pub cert: Option<PathBuf>,
    /// This coordinator's private key.
    #[arg(long, value_name = "FILE")]
    pub key: Option<PathBuf>,
    /// Plain TCP without authentication (tests, trusted networks).
    #[arg(long)]
    pub insecure: bool,
    /// Least freeze bound of a checkpoint, in ms (config `freeze_timeout_ms`).
    #[arg(long, value_name = "MS")]
    pub freeze_timeout_ms: Option<u64>,
}

/// The config file as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FileConfig {
    pub listen: String,
    pub db: PathBuf,
    pub heartbeat_ms: u32,
    pub node_timeout_ms: u64,
    pub max_heartbeats_per_s: u32,
    pub timeout_secs: u32,
    pub freeze_timeout_ms: u64,
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub insecure: bool,
}

impl Default for FileConfig {
    fn default() -> Self {
        FileConfig {
            listen: format!("0.0.0.0:{}", cr_rpc::COORDINATOR_PORT),
            db: PathBuf::from(DEFAULT_DB),
            heartbeat_ms: 1000,
            node_timeout_ms: 5000,
            max_heartbeats_per_s: crate::coordinator::DEFAULT_MAX_HEARTBEATS_PER_S,
            timeout_secs: 120,
            freeze_timeout_ms: crate::coordinator::DEFAULT_FREEZE_TIMEOUT.as_millis() as u64,
            ca: None,
            cert: None,
            key: None,
            insecure: false,
        }
    }
}

/// The effective configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    pub db: PathBuf,
    /// Heartbeat period told to agents.
    pub heartbeat_ms: u32,
    /// No heartbeat this long: the node is down.
    pub node_timeout: Duration,
    /// Heartbeats a second taken at most (the period grows with the nodes).
    pub max_heartbeats_per_s: u32,
    /// Default deadline of a checkpoint or a restart.
    pub timeout: Duration,
    /// Least freeze bound of a checkpoint.
    pub freeze_timeout: Duration,
    pub tls: TlsFiles,
}

impl Config {
    /// Read the config file (the default one may be missing) and apply the flags.
    pub fn load(args: &Args) -> Result<Config, ConfigError> {
        let (path, required) = match &args.config {
            Some(p) => (p.clone(), true),
            None => (PathBuf::from(DEFAULT_CONFIG), false),
        };
        let file: FileConfig = cr_rpc::config::load(&path, required)?;
        Config::merge(file, args)
    }

    /// `file` with the flags of `args` applied.
    pub fn merge(file: FileConfig, args: &Args) -> Result<Config, ConfigError> {
        let listen_str = args.listen.clone().unwrap_or(file.listen);
        let listen = listen_str
            .parse::<SocketAddr>()
            .map_err(|e| ConfigError::Listen {
                addr: listen_str.clone(),
                what: e.to_string(),
            })?;
        let invalid = |key, value: String, what| ConfigError::Invalid { key, value, what };
        if file.heartbeat_ms == 0 {
            return Err(invalid("heartbeat_ms", "0".into(), "must be positive"));
        }
        if file.node_timeout_ms <= u64::from(file.heartbeat_ms) {
            return Err(invalid(
                "node_timeout_ms",
                file.node_timeout_ms.to_string(),
                "must be longer than heartbeat_ms",
            ));
        }
        if file.max_heartbeats_per_s == 0 {
            return Err(invalid(
                "max_heartbeats_per_s",
                "0".into(),
                "must be positive",
            ));
        }
        if file.timeout_secs == 0 {
            return Err(invalid("timeout_secs", "0".into(), "must be positive"));
        }
        let freeze_ms = args.freeze_timeout_ms.unwrap_or(file.freeze_timeout_ms);
        if freeze_ms < 100 {
            return Err(invalid(
                "freeze_timeout_ms",
                freeze_ms.to_string(),
                "must be at least 100",
            ));
        }
        let tls = TlsFiles {
            ca: file.ca,
            cert: file.cert,
            key: file.key,
            insecure: file.insecure,
        }
        .merge(
            args.ca.clone(),
            args.cert.clone(),
            args.key.clone(),
            args.insecure,
        );
        Ok(Config {
            listen,
            db: args.db.clone().unwrap_or(file.db),
            heartbeat_ms: file.heartbeat_ms,
            node_timeout: Duration::from_millis(file.node_timeout_ms),
            max_heartbeats_per_s: file.max_heartbeats_per_s,
            timeout: Duration::from_secs(u64::from(file.timeout_secs)),
            freeze_timeout: Duration::from_millis(freeze_ms),
            tls,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_flags() {
        let args = Args {
            listen: Some("127.0.0.1:9000".into()),
            insecure: true,
            ..Args::default()
        };
        let c = Config::merge(FileConfig::default(), &args).unwrap();
        assert_eq!(c.listen.to_string(), "127.0.0.1:9000");
        assert_eq!(c.db, PathBuf::from(DEFAULT_DB));
        assert_eq!(c.node_timeout, Duration::from_secs(5));
        assert!(c.tls.insecure);
    }

    #[test]
    fn unknown_keys_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.toml");
        std::fs::write(&p, "listen = \"127.0.0.1:1\"\nbogus = 1\n").unwrap();
        let e = cr_rpc::config::load::<FileConfig>(&p, true).unwrap_err();
        assert!(e.to_string().contains("bogus"), "{e}");
        std::fs::write(&p, "db = \"/tmp/x.redb\"\ntimeout_secs = 7\n").unwrap();
        let f = cr_rpc::config::load::<FileConfig>(&p, true).unwrap();
        assert_eq!(f.timeout_secs, 7);
        assert_eq!(f.heartbeat_ms, 1000);
        assert_eq!(f.max_heartbeats_per_s, 1000);
        std::fs::write(&p, "max_heartbeats_per_s = 0\n").unwrap();
        let f = cr_rpc::config::load::<FileConfig>(&p, true).unwrap();
        let e = Config::merge(f, &Args::default()).unwrap_err();
        assert!(e.to_string().contains("max_heartbeats_per_s"), "{e}");
    }
}
