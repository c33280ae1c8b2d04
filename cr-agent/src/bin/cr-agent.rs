//! `cr-agent`: the node agent daemon (see `cr_agent::agent` and docs/CLUSTER.md).
#![forbid(unsafe_code)]

use clap::Parser;
use cr_agent::agent::config::{Config, FileConfig};
use std::path::PathBuf;
use std::process::ExitCode;

/// The node agent: checkpoints and restores the node's job processes for
/// the coordinator and for local users.
#[derive(Parser)]
#[command(name = "cr-agent", version)]
struct Cli {
    /// Configuration file (TOML) [default: /etc/cr/agent.toml if it exists].
    #[arg(long, short = 'c')]
    config: Option<PathBuf>,
    /// Node name (and the TLS name of its certificate) [default: hostname].
    #[arg(long)]
    node: Option<String>,
    /// IP:PORT of the Agent service [default: 0.0.0.0:7171].
    #[arg(long)]
    listen: Option<String>,
    /// HOST:PORT the coordinator dials [default: --listen].
    #[arg(long)]
    advertise: Option<String>,
    /// Unix socket for local clients [default: /run/cr/agent.sock].
    #[arg(long)]
    socket: Option<PathBuf>,
    /// ADDR:PORT of cr-coordinatord [default: none, a standalone node].
    #[arg(long)]
    coordinator: Option<String>,
    /// TLS name of the coordinator [default: cr-coordinatord].
    #[arg(long)]
    coordinator_name: Option<String>,
    /// Image root [default: /var/lib/cr/images].
    #[arg(long)]
    images: Option<PathBuf>,
    /// State directory [default: /run/cr/agent].
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// An IP address the node's processes use (repeatable) [default: the advertised one].
    #[arg(long = "address")]
    addresses: Vec<String>,
    /// The cluster CA's certificate (PEM).
    #[arg(long)]
    ca: Option<PathBuf>,
    /// This node's certificate, signed by the CA (PEM).
    #[arg(long)]
    cert: Option<PathBuf>,
    /// This node's private key (PEM).
    #[arg(long)]
    key: Option<PathBuf>,
    /// Plain TCP without authentication (trusted networks and tests only).
    #[arg(long)]
    insecure: bool,
    /// A command (run by /bin/sh -c) checking the node's health: after
    /// --health-failures failures in a row (exit status not 0, or running
    /// longer than the interval) the agent asks the coordinator to drain
    /// this node.
    #[arg(long, value_name = "CMD")]
    health_check: Option<String>,
    /// Run the health check every SECS seconds [default: 30].
    #[arg(long, value_name = "SECS")]
    health_interval: Option<f64>,
    /// Failures in a row that drain the node [default: 3].
    #[arg(long, value_name = "N")]
    health_failures: Option<u32>,
    /// The node's cgroup v2 directory (a node run as a container): the free
    /// memory and CPUs reported to the coordinator are lowered by its (and
    /// its ancestors') memory.max and cpu.max [default: the agent's own
    /// cgroup].
    #[arg(long, value_name = "DIR")]
    node_cgroup: Option<PathBuf>,
}

fn config(cli: Cli) -> Result<Config, String> {
    let (path, required) = match &cli.config {
        Some(p) => (p.clone(), true),
        None => (PathBuf::from("/etc/cr/agent.toml"), false),
    };
    let mut f: FileConfig = cr_rpc::config::load(&path, required).map_err(|e| e.to_string())?;
    macro_rules! flag {
        ($($name:ident),*) => { $( if cli.$name.is_some() { f.$name = cli.$name; } )* };
    }
    flag!(
        node,
        listen,
        advertise,
        socket,
        coordinator,
        coordinator_name,
        images,
        state_dir,
        ca,
        cert,
        key,
        node_cgroup
    );
    if !cli.addresses.is_empty() {
        f.addresses = Some(cli.addresses);
    }
    if cli.insecure {
        f.insecure = Some(true);
    }
    if cli.health_check.is_some() {
        f.health_check = cli.health_check;
    }
    if cli.health_interval.is_some() {
        f.health_interval_secs = cli.health_interval;
    }
    if cli.health_failures.is_some() {
        f.health_failures = cli.health_failures;
    }
    Config::resolve(f).map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    cr_rpc::logging::init_daemon();
    let result = config(Cli::parse()).and_then(|cfg| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the runtime: {e}"))?
            .block_on(cr_agent::agent::serve(cfg))
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cr-agent: error: {e}");
            ExitCode::FAILURE
        }
    }
}
