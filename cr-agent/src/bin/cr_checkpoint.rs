//! `cr_checkpoint`: checkpoint a running process into an image directory.
#![forbid(unsafe_code)]

use clap::Parser;
use cr_agent::{checkpoint, Action, Options};
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
    };
    match checkpoint(pid, &opts) {
        Ok(s) => {
            if !cli.quiet {
                let secs = s.elapsed.as_secs_f64();
                println!(
                    "checkpointed pid {} ({} processes, {} threads) into {}: {:.1} MiB of pages, {} vmas, {} fds in {:.3} s ({:.2} GB/s), frozen {:.3} s",
                    s.pid,
                    s.processes,
                    s.threads,
                    opts.dir.display(),
                    s.page_bytes as f64 / (1 << 20) as f64,
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
            eprintln!("cr_checkpoint: error: {}", cr_sys::error::one_line(&e));
            ExitCode::FAILURE
        }
    }
}
