//! cr-coordinatord: serves the Coordinator service (docs/CLUSTER.md) until
//! SIGTERM or SIGINT; then operations in progress end with a recorded
//! decision (aborted unless committed) before it exits.
#![forbid(unsafe_code)]

use clap::Parser;
use cr_coordinatord::config::{Args, Config, ConfigError};
use cr_coordinatord::service::Service;
use cr_coordinatord::{schedule, Catalog, CatalogError, Coordinator, GrpcAgents, Settings};
use cr_rpc::tls::Security;
use std::sync::Arc;
use std::time::Duration;

/// How long a stop waits for operations in progress to reach their decision.
const STOP_GRACE: Duration = Duration::from_secs(30);
/// Connect timeout of the channels to agents.
const AGENT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
enum MainError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Tls(#[from] cr_rpc::RpcError),
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    #[error("TLS set-up with {cert} and {key}: {what}")]
    TlsSetup {
        cert: String,
        key: String,
        what: String,
    },
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("server: {0}")]
    Serve(String),
    #[error("cannot start the runtime: {0}")]
    Runtime(std::io::Error),
}

/// Listen queue of the Coordinator service: thousands of agents connect at
/// once when it starts (tokio's default, 1024, would drop their SYNs and
/// make them retry a second later; the kernel caps it at somaxconn).
const LISTEN_BACKLOG: u32 = 65535;

fn listen(addr: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let sock = match addr {
        std::net::SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        std::net::SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    sock.set_reuseaddr(true)?;
    sock.bind(addr)?;
    sock.listen(LISTEN_BACKLOG)
}

async fn serve(cfg: Config) -> Result<(), MainError> {
    let security = Security::load(&cfg.tls)?;
    let catalog = Arc::new(Catalog::open(&cfg.db)?);
    for id in catalog.aborted_at_open() {
        tracing::warn!(checkpoint = %id, "in progress when the coordinator stopped: aborted");
    }
    let unfinished = catalog.unfinished();
    if !unfinished.is_empty() {
        tracing::info!(
            checkpoints = ?unfinished.iter().map(|c| c.id().to_string()).collect::<Vec<_>>(),
            "FINISH not acknowledged yet: sent again when their agents register"
        );
    }
    let settings = Settings {
        heartbeat_ms: cfg.heartbeat_ms,
        node_timeout: cfg.node_timeout,
        max_heartbeats_per_s: cfg.max_heartbeats_per_s,
        timeout: cfg.timeout,
        freeze_timeout: cfg.freeze_timeout,
    };
    let agents = Arc::new(GrpcAgents::new(
        catalog.clone(),
        security.clone(),
        AGENT_CONNECT_TIMEOUT,
        // The protocol's own deadlines are shorter; this only bounds
        // calls that would hang forever.
        cfg.timeout + Duration::from_secs(30),
    ));
    let coord = Arc::new(Coordinator::new(catalog, agents, settings));

    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = security.server() {
        builder = builder.tls_config(tls).map_err(|e| {
            let show = |p: &Option<std::path::PathBuf>| {
                p.as_ref().map_or("-".into(), |p| p.display().to_string())
            };
            MainError::TlsSetup {
                cert: show(&cfg.tls.cert),
                key: show(&cfg.tls.key),
                what: cr_rpc::error::innermost(&e),
            }
        })?;
    }
    let listener = listen(cfg.listen).map_err(|source| MainError::Listen {
        addr: cfg.listen,
        source,
    })?;
    let addr = listener.local_addr().unwrap_or(cfg.listen);
    tracing::info!(
        db = %cfg.db.display(),
        tls = security.is_tls(),
        "listening on {addr}"
    );
    let sched = tokio::spawn(schedule::supervise(coord.clone()));
    let recover = coord.clone();
    let recovery = tokio::spawn(async move { recover.recover_migrations().await });
    let stop = coord.clone();
    let res = builder
        .add_service(Service::server(coord.clone()))
        .serve_with_incoming_shutdown(cr_rpc::channel::incoming(listener), async move {
            let sig = cr_rpc::shutdown::signal().await;
            tracing::info!("{sig}: stopping");
            stop.shutdown(STOP_GRACE).await;
        })
        .await;
    sched.abort();
    recovery.abort();
    res.map_err(|e| MainError::Serve(cr_rpc::error::innermost(&e)))?;
    tracing::info!("stopped");
    Ok(())
}

fn main() {
    let args = Args::parse();
    cr_rpc::logging::init_daemon();
    // A connection from and one to every agent: thousands of fds.
    match cr_sys::limits::raise_nofile() {
        Ok(n) => tracing::debug!("open files: up to {n}"),
        Err(e) => tracing::warn!("cannot raise the limit of open files: {e}"),
    }
    let res = Config::load(&args)
        .map_err(MainError::from)
        .and_then(|cfg| {
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .map_err(MainError::Runtime)?
                .block_on(serve(cfg))
        });
    if let Err(e) = res {
        eprintln!("cr-coordinatord: error: {e}");
        std::process::exit(1);
    }
}
