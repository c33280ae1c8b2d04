//! `cr_checkpoint`: checkpoint a running process into an image directory.
#![forbid(unsafe_code)]

use clap::Parser;
use cr_engine::{checkpoint, CheckpointOptions, Summary};
use std::io::IsTerminal;
use std::process::ExitCode;

/// Checkpoint a running process and all its descendants. By default they keep running.
#[derive(Parser)]
#[command(name = "cr_checkpoint", version)]
struct Cli {
    #[command(flatten)]
    opts: CheckpointOptions,
    /// Only list every resource of the tree and whether it can be saved;
    /// exit 1 if any cannot. Nothing is frozen or written.
    #[arg(long)]
    check: bool,
    /// Accepted for compatibility with CRIU: a job attached to a terminal
    /// outside the tree is always allowed (use `cr_restart --shell-job`).
    #[arg(long)]
    shell_job: bool,
    /// Accepted for compatibility with CRIU: established TCP connections
    /// are always saved (and held by the network lock until the restore).
    #[arg(long)]
    tcp_established: bool,
    /// Work without the node's agent even when it runs (otherwise the
    /// checkpoint goes through it, on behalf of the caller).
    #[arg(long)]
    standalone: bool,
    /// Print nothing on success.
    #[arg(long, short = 'q')]
    quiet: bool,
    /// For programs: progress as `{"progress": {...}}` lines and the
    /// outcome as one `{"result": {...}}` or `{"error": "..."}` line, on
    /// stdout.
    #[arg(long)]
    json: bool,
    /// Checkpoint cluster job NAME as one (every member on every node),
    /// through the node's agent and the coordinator, as your user (who
    /// must own every member); --kill and --stop apply to the whole job.
    #[arg(long, value_name = "NAME", conflicts_with_all = ["pid", "slurm"])]
    job: Option<String>,
    /// Checkpoint Slurm job JOBID (a job submitted with `--checkpoint`:
    /// cluster job `slurm-JOBID`), as --job does.
    #[arg(long, value_name = "JOBID", conflicts_with = "pid")]
    slurm: Option<u32>,
    /// For libcr (cr_request_checkpoint without an agent): detach from the
    /// caller at once, checkpoint PID, and tell its libcr how request N
    /// ended.
    #[arg(long, value_name = "N", hide = true, requires = "pid")]
    libcr_request: Option<u64>,
    /// Process to checkpoint, with all its descendants (for a job started with
    /// cr_run, the PID of cr_run or of the job).
    #[arg(required_unless_present_any = ["job", "slurm"])]
    pid: Option<i32>,
}

/// Set in the detached copy of a `--libcr-request` cr_checkpoint.
const DETACHED_ENV: &str = "CR_LIBCR_DETACHED";

fn main() -> ExitCode {
    let detached = std::env::var_os(DETACHED_ENV).is_some();
    if detached {
        // The program's files stay the program's.
        if let Err(e) = cr_sys::coop::close_inherited_fds() {
            eprintln!("cr_checkpoint: error: {e}");
            return ExitCode::FAILURE;
        }
    }
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("CR_LOG"))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let mut cli = Cli::parse();
    // The cluster job of a Slurm job (as cr_spank names it).
    let job = cli
        .job
        .clone()
        .or(cli.slurm.map(|id| format!("slurm-{id}")));
    let Some(pid) = cli.pid.filter(|_| job.is_none()) else {
        return cluster_job(job.as_deref().unwrap_or_default(), &cli);
    };
    if let Some(request) = cli.libcr_request {
        return libcr_request(request, pid, detached, &mut cli);
    }
    let pid = cr_engine::capture::job_root(pid);
    if cli.check {
        return check(pid, cli.quiet);
    }
    cli.opts.track_mem |= cli.opts.pre_dump;
    cli.opts.progress = if cli.json {
        cr_engine::options::Progress::Json
    } else if cli.quiet {
        cr_engine::options::Progress::Off
    } else {
        cr_engine::options::Progress::Bar
    };
    let dir = cli.opts.image_dir(pid);
    cli.opts.dir = Some(dir.clone());
    let agent = if cli.standalone {
        None
    } else {
        cr_rpc::local::Agent::if_running()
    };
    let result = match agent {
        Some(a) => through_agent(a, pid, &cli.opts),
        None => {
            // Ctrl-C or SIGTERM: the checkpoint stops, the processes run on.
            let _watch = cr_engine::interrupt::Watch::new();
            checkpoint(pid, &cli.opts).map_err(|e| cr_sys::error::one_line(&e))
        }
    };
    match result {
        Ok(s) => {
            if cli.json {
                println!("{}", json_result(&dir, &s));
            } else if !cli.quiet {
                report(&cli.opts, &dir, &s);
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            if cli.json {
                println!("{}", serde_json::json!({ "error": e }));
            }
            eprintln!("cr_checkpoint: error: {e}");
            let code = cr_engine::interrupt::exit_code().unwrap_or(1);
            ExitCode::from(code.clamp(1, 255) as u8)
        }
    }
}

/// `--libcr-request N`: the caller (libcr, in process `pid`) waits only
/// for this copy to start a detached one, no part of its tree, which
/// takes the checkpoint and tells libcr how it ended (DONE on its socket).
fn libcr_request(request: u64, pid: i32, detached: bool, cli: &mut Cli) -> ExitCode {
    if !detached {
        let me = std::env::current_exe().unwrap_or_else(|_| "cr_checkpoint".into());
        return match std::process::Command::new(&me)
            .args(std::env::args_os().skip(1))
            .env(DETACHED_ENV, "1")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .spawn()
        {
            Ok(_) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("cr_checkpoint: error: cannot start {}: {e}", me.display());
                ExitCode::FAILURE
            }
        };
    }
    let root = cr_engine::capture::job_root(pid);
    let dir = cli.opts.image_dir(root);
    cli.opts.dir = Some(dir.clone());
    let _watch = cr_engine::interrupt::Watch::new();
    let done = match checkpoint(root, &cli.opts) {
        Ok(s) => cr_proto::coop::Done {
            request,
            ok: true,
            message: format!(
                "checkpoint of {} processes into {}",
                s.processes,
                dir.display()
            ),
        },
        Err(e) => {
            let e = cr_sys::error::one_line(&e);
            eprintln!("cr_checkpoint: error: {e}");
            cr_proto::coop::Done {
                request,
                ok: false,
                message: e,
            }
        }
    };
    cr_engine::coop::tell_done(pid, &done);
    if done.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn report(opts: &CheckpointOptions, dir: &std::path::Path, s: &Summary) {
    let secs = s.elapsed.as_secs_f64();
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let what = if opts.pre_dump {
        "pre-dumped"
    } else {
        "checkpointed"
    };
    let incremental = if opts.parent.is_some() {
        format!(
            ", {:.1} MiB unchanged since the parent (found by {})",
            mib(s.pages_parent * 4096),
            s.dirty.name()
        )
    } else {
        String::new()
    };
    let tree = if opts.pre_dump {
        format!("{} processes", s.processes)
    } else {
        format!("{} processes, {} threads", s.processes, s.threads)
    };
    println!(
        "{what} pid {} ({tree}) into {}: {:.1} MiB of pages read, {:.1} MiB stored{incremental}; {} vmas, {} fds in {:.3} s ({:.2} GB/s), frozen {:.3} s",
        s.pid,
        dir.display(),
        mib(s.page_bytes),
        mib(s.store_bytes),
        s.vmas,
        s.fds,
        secs,
        s.page_bytes as f64 / secs / 1e9,
        s.frozen.as_secs_f64()
    );
}

/// `{"result": {...}}`: the summary for programs.
fn json_result(dir: &std::path::Path, s: &Summary) -> serde_json::Value {
    serde_json::json!({ "result": {
        "pid": s.pid,
        "dir": dir.display().to_string(),
        "processes": s.processes,
        "threads": s.threads,
        "page_bytes": s.page_bytes,
        "store_bytes": s.store_bytes,
        "pages_parent": s.pages_parent,
        "dirty": s.dirty.name(),
        "vmas": s.vmas,
        "fds": s.fds,
        "frozen_secs": s.frozen.as_secs_f64(),
        "elapsed_secs": s.elapsed.as_secs_f64(),
    }})
}

/// The checkpoint made by the node's agent, on behalf of the caller.
fn through_agent(
    mut agent: cr_rpc::local::Agent,
    pid: i32,
    opts: &CheckpointOptions,
) -> Result<Summary, String> {
    let abs =
        |p: &std::path::Path| std::path::absolute(p).map_err(|e| format!("{}: {e}", p.display()));
    tracing::debug!(socket = %agent.socket.display(), "checkpoint through the agent");
    let mut opts = opts.clone();
    opts.parent = opts.parent.as_deref().map(abs).transpose()?;
    let dir = abs(&opts.image_dir(pid))?;
    let r = agent.checkpoint(cr_rpc::opts::checkpoint_request(pid, &dir, &opts))?;
    Ok(cr_rpc::opts::summary(&r))
}

/// `--job`, `--slurm`: a coordinated checkpoint of cluster job `job`
/// through the node's agent. Exit 0 when carried out, 1 when not, 2 when
/// committed but --kill/--stop was not carried out on some node (as crctl).
fn cluster_job(job: &str, cli: &Cli) -> ExitCode {
    let fail = |e: String, code: u8| {
        if cli.json {
            println!("{}", serde_json::json!({ "error": e }));
        }
        eprintln!("cr_checkpoint: error: {e}");
        ExitCode::from(code)
    };
    let socket = cr_rpc::channel::agent_socket();
    let mut agent = match cr_rpc::local::Agent::connect(&socket) {
        Ok(a) => a,
        Err(e) => return fail(format!("--job needs the node's cr-agent: {e}"), 1),
    };
    let after = match cli.opts.action() {
        cr_engine::options::Action::Kill => cr_rpc::pb::After::Kill,
        cr_engine::options::Action::Stop => cr_rpc::pb::After::Stop,
        _ => cr_rpc::pb::After::Continue,
    };
    let req = cr_rpc::pb::CheckpointRequest {
        job: job.to_string(),
        after: after as i32,
        ..Default::default()
    };
    let info = match agent.checkpoint_job(req) {
        Ok(i) => i,
        Err(e) => return fail(e, 1),
    };
    let nodes: std::collections::BTreeSet<&str> =
        info.images.iter().map(|i| i.node.as_str()).collect();
    let procs: u32 = info.images.iter().map(|i| i.processes).sum();
    if cli.json {
        println!(
            "{}",
            serde_json::json!({ "result": {
                "checkpoint": info.id,
                "job": info.job,
                "processes": procs,
                "nodes": nodes.len(),
                "pause_ms": info.pause_ms,
                "unfinished": info.unfinished,
            }})
        );
    } else if !cli.quiet {
        println!(
            "checkpoint {} committed: {procs} processes on {} nodes, paused {} ms",
            info.id,
            nodes.len(),
            info.pause_ms
        );
        for n in &info.notes {
            println!("note: {n}");
        }
    }
    if !info.unfinished.is_empty() {
        eprintln!(
            "cr_checkpoint: checkpoint {} committed, but not carried out on {}",
            info.id,
            info.unfinished.join(", ")
        );
        return ExitCode::from(2);
    }
    ExitCode::SUCCESS
}

/// `--check`: the pre-flight report.
fn check(pid: i32, quiet: bool) -> ExitCode {
    let items = match cr_engine::check::check(pid) {
        Ok(i) => i,
        Err(e) => {
            eprintln!("cr_checkpoint: error: {}", cr_sys::error::one_line(&e));
            return ExitCode::FAILURE;
        }
    };
    if !quiet {
        for i in &items {
            let verdict = match &i.refused {
                None => "ok".to_string(),
                Some(why) => format!("CANNOT BE SAVED: {why}"),
            };
            println!("pid {:<7} {:<8} {}: {verdict}", i.pid, i.resource, i.what);
        }
    }
    let refused: Vec<_> = items.iter().filter(|i| i.refused.is_some()).collect();
    if let Some(first) = refused.first() {
        eprintln!(
            "cr_checkpoint: error: process {}: {} is {}",
            first.pid,
            first.resource,
            first.refused.as_deref().unwrap_or_default()
        );
        if refused.len() > 1 {
            eprintln!(
                "cr_checkpoint: {} more resources cannot be saved (listed above)",
                refused.len() - 1
            );
        }
        return ExitCode::FAILURE;
    }
    if !quiet {
        println!("all {} resources of the tree can be saved", items.len());
    }
    ExitCode::SUCCESS
}
