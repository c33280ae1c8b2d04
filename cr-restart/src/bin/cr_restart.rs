//! `cr_restart`: restore a process from an image directory.
#![forbid(unsafe_code)]

use clap::Parser;
use cr_engine::restore::{prepare, prepare_opened, wait_exit};
use cr_engine::RestoreOptions;
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
    /// Print the restored PID and return at once; the process runs on
    /// (with --lazy-pages: once its last page is in).
    #[arg(long, alias = "restore-detached")]
    detach: bool,
    /// Restore into this network namespace (a name under /run/netns, or a
    /// path such as /proc/PID/ns/net).
    #[arg(long, value_name = "NAME|PATH")]
    netns: Option<String>,
    /// Work without the node's agent even when it runs (otherwise the
    /// restore goes through it, on behalf of the caller, unless --shell-job,
    /// --netns or --lazy-pages is given).
    #[arg(long)]
    standalone: bool,
    /// For programs: progress as `{"progress": {...}}` lines, then
    /// `{"result": {"pid": N}}` once restored and `{"exit": {"status": N}}`
    /// when it ends (or `{"error": "..."}`), on stdout.
    #[arg(long)]
    json: bool,
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
    let json = cli.json;
    let fail = |msg: String| {
        if json {
            println!("{}", serde_json::json!({ "error": msg }));
        }
        eprintln!("cr_restart: error: {msg}");
        ExitCode::FAILURE
    };
    // A tree that had a network namespace of its own with loopback alone
    // gets a new one, made by this process before anything of the image.
    // The image is read once, here; an unreadable one is reported by
    // `prepare`, which reads it again.
    let chain = cr_image::chain::Chain::open(&cli.dir);
    let own_netns = match &chain {
        Ok(c) if cli.netns.is_none() => cr_engine::kinds::netns::restorable(&c.top().ck).cloned(),
        _ => None,
    };
    // Post-copy pages are served by this process (see --lazy-pages).
    let agent = if cli.standalone
        || cli.opts.shell_job
        || cli.netns.is_some()
        || own_netns.is_some()
        || cli.opts.lazy_pages
    {
        None
    } else {
        cr_rpc::local::Agent::if_running()
    };
    if let Some(agent) = agent {
        return exit_with(&cli, through_agent(agent, &cli), fail);
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
    if let Some(n) = &own_netns {
        if let Err(e) = cr_engine::kinds::netns::make(n) {
            return fail(format!(
                "cannot make the tree's network namespace again: {}",
                cr_sys::error::one_line(&e)
            ));
        }
    }
    cli.opts.progress = if cli.json {
        cr_engine::options::Progress::Json
    } else {
        cr_engine::options::Progress::Bar
    };
    // Ctrl-C or SIGTERM during the restore: nothing of the image runs.
    let watch = cr_engine::interrupt::Watch::new();
    let prepared = match chain {
        Ok(c) => prepare_opened(&cli.dir, c, &cli.opts),
        Err(_) => prepare(&cli.dir, &cli.opts),
    };
    let restored = prepared.and_then(|mut ready| {
        let lazy = ready.take_lazy();
        ready.release().map(|pid| (pid, lazy))
    });
    let result = restored.and_then(|(pid, lazy)| {
        restored_pid(&cli, pid);
        if !lazy.is_empty() {
            // The process runs; it needs us until its last page is in (a
            // signal now kills it: its missing pages would read as zeros).
            let stats = lazy.wait()?;
            tracing::info!(
                pid,
                faults = stats.faults,
                pushed_mib = stats.pushed_bytes >> 20,
                ms = stats.ms,
                "every page is in"
            );
        }
        drop(watch);
        if cli.detach {
            Ok(0)
        } else {
            wait_exit(pid)
        }
    });
    exit_with(&cli, result.map_err(|e| cr_sys::error::one_line(&e)), fail)
}

/// Say the restored PID: alone on a line, or as JSON.
fn restored_pid(cli: &Cli, pid: i32) {
    if cli.json {
        println!("{}", serde_json::json!({ "result": { "pid": pid } }));
    } else if cli.detach {
        println!("{pid}");
    }
}

/// Exit with the restored root's status (or the error).
fn exit_with(
    cli: &Cli,
    result: Result<i32, String>,
    fail: impl Fn(String) -> ExitCode,
) -> ExitCode {
    match result {
        Ok(code) => {
            if cli.json && !cli.detach {
                println!("{}", serde_json::json!({ "exit": { "status": code } }));
            }
            ExitCode::from(code.clamp(0, 255) as u8)
        }
        Err(e) => fail(e),
    }
}

/// The restore made by the node's agent, on behalf of the caller; the
/// restored root is the agent's child, so its exit status comes from it.
fn through_agent(mut agent: cr_rpc::local::Agent, cli: &Cli) -> Result<i32, String> {
    let dir = std::path::absolute(&cli.dir).map_err(|e| format!("{}: {e}", cli.dir.display()))?;
    tracing::debug!(socket = %agent.socket.display(), "restore through the agent");
    let pid = agent.restore(cr_rpc::opts::restore_request(&dir, &cli.opts))?;
    restored_pid(cli, pid);
    if cli.detach {
        return Ok(0);
    }
    agent.wait(pid)
}
