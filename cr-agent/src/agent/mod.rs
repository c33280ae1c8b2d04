//! The node agent daemon (`cr-agent`): serves the coordinator (the
//! [`remote`] Agent service, TCP with mutual TLS) and the node's users (the
//! [`local`] service on a Unix socket, callers authorized by [`authz`]),
//! keeps the node's job members ([`members`]), runs the steps of the
//! coordinated protocol on session threads ([`sessions`]), reaps the
//! processes it restored ([`reaper`]), keeps the node registered with the
//! coordinator ([`link`]) and starts job members for other nodes
//! ([`launch`], cr_rsh), and drains its node when its [`health`] check
//! fails. docs/CLUSTER.md describes it for users.

pub mod authz;
pub mod config;
pub mod fault;
pub mod health;
pub mod jobback;
pub mod launch;
pub mod leases;
pub mod libcr_socket;
pub mod link;
pub mod local;
pub mod members;
pub mod postcopy;
pub mod reaper;
pub mod remote;
pub mod sessions;
pub mod transfer;

use config::Config;
use cr_rpc::pb;
use cr_rpc::tls::Security;
use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tracing::{info, warn};

/// What the services and session threads share.
pub struct Shared {
    pub config: Config,
    pub members: members::Members,
    pub sessions: sessions::Sessions,
    pub reaper: Arc<reaper::Reaper>,
    /// Leases of the sessions' network locks.
    pub leases: Arc<leases::Leases>,
    /// Threads copying pages in a dump or restore.
    pub workers: usize,
    /// Wakes the link to report a membership change at once.
    pub wake: Notify,
    /// The channel to the coordinator, once the link made it.
    pub coordinator: std::sync::OnceLock<tonic::transport::Channel>,
    /// TLS of the node (its certificate also serves as a client's, to
    /// fetch images from other agents).
    pub security: Security,
    /// The coordinator says the node is drained: new members are refused.
    pub drained: std::sync::atomic::AtomicBool,
    /// Page stores arriving from other nodes (post-copy migration).
    pub postcopies: Arc<postcopy::PostCopies>,
    /// Restored members whose restart callbacks wait for the whole job.
    pub job_back: Arc<jobback::JobBack>,
    /// Image copies to this node in progress, told to the coordinator
    /// with the heartbeats.
    pub transfers: transfer::Transfers,
    /// Channels to other agents (image copies, post-copy), kept open.
    pub peers: transfer::Peers,
}

/// Bind the Unix socket: refused if another agent answers on it; a stale
/// file is replaced. Open to every local user (callers are authorized per
/// request by their credentials).
fn bind_socket(path: &std::path::Path) -> Result<tokio::net::UnixListener, String> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(format!(
            "another cr-agent serves {} already",
            path.display()
        ));
    }
    let _ = std::fs::remove_file(path);
    let l = tokio::net::UnixListener::bind(path)
        .map_err(|e| format!("cannot listen on {}: {e}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))
        .map_err(|e| format!("cannot open {} to users: {e}", path.display()))?;
    Ok(l)
}

/// How long a stop waits for each session in progress to abort.
const STOP_ABORT_TIMEOUT: Duration = Duration::from_secs(5);

/// Await every future (the agent has no futures-util of its own).
async fn futures_join_all<F: std::future::Future<Output = ()> + Send + 'static>(
    futs: impl IntoIterator<Item = F>,
) {
    let handles: Vec<_> = futs.into_iter().map(tokio::spawn).collect();
    for h in handles {
        let _ = h.await;
    }
}

/// Run the agent until SIGTERM or SIGINT.
pub async fn serve(config: Config) -> Result<(), String> {
    let sec = Security::load(&config.tls).map_err(|e| e.to_string())?;
    for d in [&config.state_dir, &config.images] {
        std::fs::create_dir_all(d).map_err(|e| format!("cannot create {}: {e}", d.display()))?;
    }
    sessions::sweep(&config.state_dir);
    transfer::sweep(&config.images);
    let workers = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let shared = Arc::new(Shared {
        members: members::Members::load(&config.state_dir),
        sessions: sessions::Sessions::default(),
        reaper: Arc::new(reaper::Reaper::default()),
        leases: leases::Leases::new(Duration::from_millis(config.lock_lease_ms)),
        workers,
        wake: Notify::new(),
        coordinator: std::sync::OnceLock::new(),
        security: sec.clone(),
        drained: std::sync::atomic::AtomicBool::new(false),
        postcopies: Arc::default(),
        job_back: Arc::default(),
        transfers: transfer::Transfers::default(),
        peers: transfer::Peers::default(),
        config,
    });
    shared.reaper.spawn(Duration::from_millis(100));
    shared.leases.spawn();
    let cfg = &shared.config;

    let uds = bind_socket(&cfg.socket)?;
    let libcr_uds = bind_socket(&cr_proto::coop::agent_libcr_socket(&cfg.socket))?;
    let tcp = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", cfg.listen))?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };

    // A keepalive: a call whose caller is cut off (the coordinator's link
    // cut during a FETCH) is dropped within seconds, and undone.
    let mut remote = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(1)))
        .http2_keepalive_timeout(Some(Duration::from_secs(3)));
    if let Some(tls) = sec.server() {
        remote = remote.tls_config(tls).map_err(|e| format!("TLS: {e}"))?;
    }
    let remote = remote
        .add_service(pb::agent_server::AgentServer::new(remote::AgentService {
            shared: shared.clone(),
        }))
        .serve_with_incoming_shutdown(cr_rpc::channel::incoming(tcp), stopped(stop_rx.clone()));
    let local = tonic::transport::Server::builder()
        .add_service(pb::local_server::LocalServer::new(local::LocalService {
            shared: shared.clone(),
        }))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::UnixListenerStream::new(uds),
            stopped(stop_rx.clone()),
        );
    let remote = tokio::spawn(remote);
    let local = tokio::spawn(local);
    let libcr = tokio::spawn(libcr_socket::serve(
        shared.clone(),
        libcr_uds,
        stopped(stop_rx.clone()),
    ));
    let sweeper = tokio::spawn(libcr_socket::sweep_periodically());
    let link = tokio::spawn(link::run(shared.clone(), sec.clone()));
    let health = cfg
        .health
        .clone()
        .map(|h| tokio::spawn(health::run(shared.clone(), h)));
    info!(
        node = cfg.node,
        listen = %cfg.listen,
        socket = %cfg.socket.display(),
        coordinator = cfg.coordinator.as_deref().unwrap_or("none (standalone)"),
        tls = sec.is_tls(),
        "cr-agent running"
    );

    let sig = cr_rpc::shutdown::signal().await;
    info!(signal = sig, "stopping");
    link.abort();
    sweeper.abort();
    if let Some(h) = health {
        h.abort();
    }
    // Sessions in progress end as an abort would: the processes run on.
    // All at once, and bounded: a session that does not answer in time is
    // left to the exit (its tracees are detached by the kernel) and to the
    // sweep below (its locks and uncommitted images go).
    let aborts = shared.sessions.ids().into_iter().map(|id| {
        let sh = shared.clone();
        async move {
            match tokio::time::timeout(STOP_ABORT_TIMEOUT, sh.sessions.let_go(&id)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => warn!(session = id, error = e, "aborting a session at shutdown"),
                Err(_) => warn!(session = id, "a session did not end in time at shutdown"),
            }
        }
    });
    futures_join_all(aborts).await;
    if shared.sessions.count() > 0 {
        let dir = shared.config.state_dir.clone();
        let _ = tokio::task::spawn_blocking(move || sessions::sweep(&dir)).await;
    }
    let _ = stop_tx.send(true);
    let wait = tokio::time::timeout(Duration::from_secs(5), async {
        let _ = remote.await;
        let _ = local.await;
        let _ = libcr.await;
    });
    if wait.await.is_err() {
        warn!("requests still running after 5 s; stopping anyway");
    }
    let _ = std::fs::remove_file(&cfg.socket);
    info!("stopped");
    Ok(())
}
