//! `cr_restart`: restore a process from an image directory.
#![forbid(unsafe_code)]

use clap::Parser;
use cr_engine::restore::wait_exit;
use cr_engine::{restore, RestoreOptions};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

/// Restore a checkpointed process with its original PID. Without --detach,
/// cr_restart waits for it and exits with its status.
#[derive(Parser)]
#[command(name = "cr_restart", version)]
struct Cli {
    #[command(flatten)]
    opts: RestoreOptions,
    /// Print the restored PID and return at once; the process runs on.
    #[arg(long)]
    detach: bool,
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
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let mut cli = Cli::parse();
    let fail = |msg: String| {
        eprintln!("cr_restart: error: {msg}");
        ExitCode::FAILURE
    };
    let agent = if cli.standalone || cli.opts.shell_job || cli.netns.is_some() {
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
    cli.opts.show_progress = std::io::stderr().is_terminal();
    // Ctrl-C or SIGTERM during the restore: nothing of the image runs.
    let watch = cr_engine::interrupt::Watch::new();
    let restored = restore(&cli.dir, &cli.opts);
    drop(watch);
    let result = restored.and_then(|pid| {
        if cli.detach {
            println!("{pid}");
            Ok(0)
        } else {
            wait_exit(pid)
        }
    });
    match result {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => fail(cr_sys::error::one_line(&e)),
    }
}

/// The restore made by the node's agent, on behalf of the caller; the
/// restored root is the agent's child, so its exit status comes from it.
fn through_agent(mut agent: cr_rpc::local::Agent, cli: &Cli) -> Result<i32, String> {
    let dir = std::path::absolute(&cli.dir).map_err(|e| format!("{}: {e}", cli.dir.display()))?;
    tracing::debug!(socket = %agent.socket.display(), "restore through the agent");
    let pid = agent.restore(cr_rpc::opts::restore_request(&dir, &cli.opts))?;
    if cli.detach {
        println!("{pid}");
        return Ok(0);
    }
    agent.wait(pid)
}
