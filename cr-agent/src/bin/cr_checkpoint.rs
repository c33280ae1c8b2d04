//! `cr_checkpoint`: checkpoint a running process into an image directory.
#![forbid(unsafe_code)]

use clap::Parser;
use cr_agent::{checkpoint, Action, Options};
use cr_image::proto::Compression;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

/// Checkpoint a running process and all its descendants. By default they keep running.
#[derive(Parser)]
#[command(name = "cr_checkpoint", version)]
struct Cli {
    /// Image directory (created if missing) [default: the job's `cr_run --dir`, else ./ckpt.PID].
    #[arg(long, short = 'd')]
    dir: Option<PathBuf>,
    /// Kill the process after a successful checkpoint.
    #[arg(long, conflicts_with = "stop")]
    kill: bool,
    /// Leave the process stopped (SIGSTOP) after a successful checkpoint.
    #[arg(long)]
    stop: bool,
    /// Do not fsync the image (faster, not crash-safe).
    #[arg(long)]
    no_fsync: bool,
    /// Threads copying memory [default: number of CPUs].
    #[arg(long)]
    workers: Option<usize>,
    /// Only list every resource of the tree and whether it can be saved;
    /// exit 1 if any cannot. Nothing is frozen or written.
    #[arg(long)]
    check: bool,
    /// Accepted for compatibility with CRIU: a job attached to a terminal
    /// outside the tree is always allowed (use `cr_restart --shell-job`).
    #[arg(long)]
    shell_job: bool,
    /// With --kill or --stop, drop TCP connections that a listening socket
    /// has not accepted yet (they cannot be put back in its queue) instead
    /// of refusing the checkpoint. Their clients will see a reset.
    #[arg(long)]
    tcp_skip_in_flight: bool,
    /// Incremental checkpoint: store only the pages written since this
    /// earlier image of the same processes, and refer to it for the rest
    /// (`cr_restart` follows the chain).
    #[arg(long, value_name = "DIR")]
    parent: Option<PathBuf>,
    /// Copy memory while the processes run on (they are frozen only to list
    /// their mappings and start dirty-page tracking). The image cannot be
    /// restored by itself: it is the --parent of the checkpoint that
    /// follows, which then freezes the processes only for what changed.
    #[arg(long, conflicts_with_all = ["kill", "stop"])]
    pre_dump: bool,
    /// Leave dirty-page tracking on in the processes, so that the next
    /// checkpoint with --parent reads only what they write from now on.
    #[arg(long)]
    track_mem: bool,
    /// How pages unchanged since --parent are found: uffd (userfaultfd
    /// write-protect, Linux 6.7+), soft-dirty, hash (read every page and
    /// compare its hash: works everywhere), or auto (the best available).
    #[arg(long, default_value = "auto", value_name = "METHOD")]
    dirty: cr_agent::tracking::Choice,
    /// Compression of the page store: none, lz4 (fast) or zstd (small).
    #[arg(long, default_value = "none", value_parser = ["none", "lz4", "zstd"])]
    compress: String,
    /// Work without the node's agent even when it runs (otherwise the
    /// checkpoint goes through it, on behalf of the caller).
    #[arg(long)]
    standalone: bool,
    /// Print nothing on success.
    #[arg(long, short = 'q')]
    quiet: bool,
    /// Process to checkpoint, with all its descendants (for a job started with
    /// cr_run, the PID of cr_run or of the job).
    pid: i32,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("CR_LOG"))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let pid = cr_agent::capture::job_root(cli.pid);
    if cli.check {
        return check(pid, cli.quiet);
    }
    let opts = Options {
        dir: cli
            .dir
            .clone()
            .or_else(|| cr_agent::capture::job_dir(pid))
            .unwrap_or_else(|| PathBuf::from(format!("ckpt.{pid}"))),
        action: if cli.kill {
            Action::Kill
        } else if cli.stop {
            Action::Stop
        } else {
            Action::Continue
        },
        fsync: !cli.no_fsync,
        workers: cli.workers.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        }),
        show_progress: std::io::stderr().is_terminal() && !cli.quiet,
        tcp_skip_in_flight: cli.tcp_skip_in_flight,
        parent: cli.parent.clone(),
        pre_dump: cli.pre_dump,
        track_mem: cli.track_mem || cli.pre_dump,
        dirty: cli.dirty,
        compression: cr_image::show::parse_compression(&cli.compress).unwrap_or(Compression::None),
        lock_name: None,
    };
    let agent = if cli.standalone {
        None
    } else {
        cr_rpc::local::Agent::if_running()
    };
    let result = match agent {
        Some(a) => through_agent(a, pid, &cli, &opts),
        None => checkpoint(pid, &opts).map_err(|e| cr_sys::error::one_line(&e)),
    };
    match result {
        Ok(s) => {
            if !cli.quiet {
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
                        cr_image::show::dirty_name(s.dirty as i32)
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
                    opts.dir.display(),
                    mib(s.page_bytes),
                    mib(s.store_bytes),
                    s.vmas,
                    s.fds,
                    secs,
                    s.page_bytes as f64 / secs / 1e9,
                    s.frozen.as_secs_f64()
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("cr_checkpoint: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The checkpoint made by the node's agent, on behalf of the caller.
fn through_agent(
    mut agent: cr_rpc::local::Agent,
    pid: i32,
    cli: &Cli,
    opts: &Options,
) -> Result<cr_agent::Summary, String> {
    use cr_rpc::pb;
    let abs = |p: &std::path::Path| {
        std::path::absolute(p)
            .map(|a| a.display().to_string())
            .map_err(|e| format!("{}: {e}", p.display()))
    };
    tracing::debug!(socket = %agent.socket.display(), "checkpoint through the agent");
    let r = agent.checkpoint(pb::LocalCheckpointRequest {
        pid,
        dir: abs(&opts.dir)?,
        after: match opts.action {
            Action::Continue => pb::After::Continue,
            Action::Stop => pb::After::Stop,
            Action::Kill => pb::After::Kill,
        } as i32,
        parent: opts
            .parent
            .as_deref()
            .map(abs)
            .transpose()?
            .unwrap_or_default(),
        pre_dump: opts.pre_dump,
        track_mem: opts.track_mem,
        dirty: cli.dirty.name().into(),
        compress: cli.compress.clone(),
        workers: cli.workers.unwrap_or(0) as u32,
        no_fsync: cli.no_fsync,
        tcp_skip_in_flight: cli.tcp_skip_in_flight,
    })?;
    Ok(cr_agent::Summary {
        pid: r.pid,
        processes: r.processes as usize,
        threads: r.threads as usize,
        page_bytes: r.page_bytes,
        store_bytes: r.store_bytes,
        pages_parent: r.pages_parent,
        dirty: cr_image::show::dirty_from_name(&r.dirty),
        vmas: r.vmas as usize,
        fds: r.fds as usize,
        frozen: std::time::Duration::from_micros(r.frozen_us),
        elapsed: std::time::Duration::from_micros(r.elapsed_us),
    })
}

/// `--check`: the pre-flight report.
fn check(pid: i32, quiet: bool) -> ExitCode {
    let items = match cr_agent::capture::check(pid) {
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
