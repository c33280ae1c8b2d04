//! The daemons' log (cr-agent, cr-coordinatord, cr-slurm-drain): tracing
//! to stderr, filtered by `CR_LOG` (default `info`), coloured only on a
//! terminal.

/// Installs the daemons' subscriber (once, at the start of `main`).
pub fn init_daemon() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("CR_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}
