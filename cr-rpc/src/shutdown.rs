//! SIGTERM and SIGINT as a future, for graceful shutdown of the daemons.

/// Resolves at the first SIGTERM or SIGINT; the name of the signal.
pub async fn signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::warn!("cannot install signal handlers; stop with SIGKILL");
        std::future::pending::<()>().await;
        unreachable!()
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}
