//! `cr_restart`: restore a process from an image directory.
#![forbid(unsafe_code)]

use clap::Parser;
use cr_restart::restore::wait_exit;
use cr_restart::{restore, Options};
use std::path::PathBuf;
use std::process::ExitCode;

/// Restore a checkpointed process with its original PID. Without --detach,
/// cr_restart waits for it and exits with its status.
#[derive(Parser)]
#[command(name = "cr_restart", version)]
struct Cli {
    /// Print the restored PID and return at once; the process runs on.
    #[arg(long)]
    detach: bool,
    /// The job was started from an interactive shell: it joins cr_restart's
    /// session, becomes the foreground job of its terminal, and its
    /// terminal settings come back.
    #[arg(long)]
    shell_job: bool,
    /// Threads filling memory [default: number of CPUs].
    #[arg(long)]
    workers: Option<usize>,
    /// Rewrite an IP address of the image's TCP and UDP sockets, on both
    /// the local and the remote end (repeatable), e.g. to restore on
    /// another host processes that talked over TCP: OLD=NEW.
    #[arg(long = "map-addr", value_name = "OLD=NEW")]
    map_addr: Vec<String>,
    /// For this many seconds after the restore, TCP connections ignore
    /// resets from their peers, so that peers restored one after the other
    /// (on other hosts) find each other; 0 turns the guard off.
    #[arg(long, value_name = "SECS", default_value_t = 60)]
    reset_guard: u32,
    /// Restore into this network namespace (a name under /run/netns, or a
    /// path such as /proc/PID/ns/net).
    #[arg(long, value_name = "NAME|PATH")]
    netns: Option<String>,
    /// Work without the node's agent even when it runs (otherwise the
    /// restore goes through it, on behalf of the caller, unless --shell-job
    /// or --netns is given).
    #[arg(long)]
    standalone: bool,
    /// Image directory written by cr_checkpoint.
    dir: PathBuf,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("CR_LOG"))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let fail = |msg: String| {
        eprintln!("cr_restart: error: {msg}");
        ExitCode::FAILURE
    };
    let addr_map = match cr_restart::inet::AddrMap::parse(&cli.map_addr) {
        Ok(m) => m,
        Err(e) => return fail(e),
    };
    let agent = if cli.standalone || cli.shell_job || cli.netns.is_some() {
        None
    } else {
        cr_rpc::local::Agent::if_running()
    };
    if let Some(agent) = agent {
        return match through_agent(agent, &cli) {
            Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
            Err(e) => fail(e),
        };
    }
    if let Some(ns) = &cli.netns {
        let path = if ns.contains('/') {
            ns.clone()
        } else {
            format!("/run/netns/{ns}")
        };
        if let Err(e) = cr_sys::inet::enter_netns(&path) {
            return fail(cr_sys::error::one_line(&e));
        }
    }
    let opts = Options {
        workers: cli.workers.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        }),
        show_progress: true,
        shell_job: cli.shell_job,
        addr_map,
        reset_guard_secs: cli.reset_guard,
    };
    let result = restore(&cli.dir, &opts).and_then(|pid| {
        if cli.detach {
            println!("{pid}");
            Ok(0)
        } else {
            wait_exit(pid)
        }
    });
    match result {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("cr_restart: error: {}", cr_sys::error::one_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// The restore made by the node's agent, on behalf of the caller; the
/// restored root is the agent's child, so its exit status comes from it.
fn through_agent(mut agent: cr_rpc::local::Agent, cli: &Cli) -> Result<i32, String> {
    let dir = std::path::absolute(&cli.dir).map_err(|e| format!("{}: {e}", cli.dir.display()))?;
    tracing::debug!(socket = %agent.socket.display(), "restore through the agent");
    let pid = agent.restore(cr_rpc::pb::LocalRestoreRequest {
        dir: dir.display().to_string(),
        map_addr: cli.map_addr.clone(),
        reset_guard_secs: cli.reset_guard,
        workers: cli.workers.unwrap_or(0) as u32,
    })?;
    if cli.detach {
        println!("{pid}");
        return Ok(0);
    }
    agent.wait(pid)
}
