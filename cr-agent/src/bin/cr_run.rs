//! `cr_run`: start a command under checkpoint control.
//!
//! The command runs as PID 1 of a new PID namespace, so its whole tree can
//! later be restored anywhere (even twice side by side) without PID clashes;
//! `cr_checkpoint` accepts the PID of cr_run or of the job. It also gets a
//! mount namespace of its own, with a /proc of its PID namespace (so
//! /proc/self is itself and only the job's processes are listed) and a
//! private tmpfs on /dev/shm, and an IPC namespace of its own: all saved
//! and restored with it. `--dir` is recorded for `cr_checkpoint` (see
//! `cr_engine::capture::job_dir`). cr_run waits for
//! the command and exits with its status; if cr_run dies (Ctrl-C, SIGTERM),
//! the job is killed with it.
//!
//! With `--job NAME` the command also becomes a member of the cluster job
//! NAME: the node's agent (cr-agent) is told about it, and the coordinator
//! then checkpoints and restarts it together with the job's other members.
#![forbid(unsafe_code)]

use clap::Parser;
use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Command, ExitCode};

/// Run a command under checkpoint control, in a new PID namespace.
#[derive(Parser)]
#[command(name = "cr_run", version)]
struct Cli {
    /// Default image directory for `cr_checkpoint` of this job.
    #[arg(long, short = 'd')]
    dir: Option<PathBuf>,
    /// Stay in the current PID namespace (a restore then needs the same PIDs free).
    #[arg(long)]
    no_pidns: bool,
    /// Make the command a member of this cluster job (needs the node's cr-agent).
    #[arg(long, value_name = "NAME")]
    job: Option<String>,
    /// Write the job's PID (as seen from here) to this file.
    #[arg(long)]
    pid_file: Option<PathBuf>,
    /// The command and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<OsString>,
}

fn run(cli: Cli) -> Result<u8, String> {
    // The agent must be there before anything is started.
    let mut agent = match &cli.job {
        Some(_) => {
            let socket = cr_rpc::channel::agent_socket();
            Some(
                cr_rpc::local::Agent::connect(&socket)
                    .map_err(|e| format!("--job needs the node's cr-agent: {e}"))?,
            )
        }
        None => None,
    };
    let dir = match &cli.dir {
        Some(d) => {
            Some(std::path::absolute(d).map_err(|e| format!("bad --dir {}: {e}", d.display()))?)
        }
        None => None,
    };
    let mut cmd = Command::new(&cli.command[0]);
    cmd.args(&cli.command[1..]);
    if !cli.no_pidns {
        cr_sys::clone::unshare_pidns().map_err(|e| {
            let hint = if cr_sys::proc::own_ids().1 == 0 {
                ""
            } else {
                " (that needs root or CAP_SYS_ADMIN: run cr_run as root, or add --no-pidns to stay in this PID namespace)"
            };
            format!("cannot create a PID namespace: {e}{hint}")
        })?;
        // Its own mount namespace (a /proc of its PID namespace, a private
        // /dev/shm) and IPC namespace, saved and restored with it.
        cr_sys::ns::unshare_job_namespaces().map_err(|e| {
            format!(
                "cannot give the job its own mount and IPC namespaces: {}",
                cr_sys::error::one_line(&e)
            )
        })?;
        cr_sys::ns::mount_proc_in_child(&mut cmd);
    }
    cr_sys::clone::kill_with_parent(&mut cmd, libc::SIGKILL);
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", cli.command[0].to_string_lossy()))?;
    // Where its checkpoints go, known to cr_checkpoint (not through the
    // job's environment, which programs rewrite).
    let record = dir
        .as_deref()
        .and_then(|d| cr_engine::capture::record_job(child.id() as i32, d));
    if let Some(f) = &cli.pid_file {
        std::fs::write(f, format!("{}\n", child.id()))
            .map_err(|e| format!("cannot write {}: {e}", f.display()))?;
    }
    if let (Some(a), Some(job)) = (agent.as_mut(), &cli.job) {
        if let Err(e) = a.join(job, child.id() as i32) {
            // A command that ended before the agent saw it (`srun sh -c
            // 'echo ...'`) had nothing to checkpoint: its status is the
            // answer, not the failed join.
            if let Ok(Some(st)) = child.try_wait() {
                tracing::warn!(job, error = %e, "the command ended before it joined the job");
                return Ok(exit_code(st));
            }
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("cannot join job {job}: {e}"));
        }
    }
    tracing::info!(pid = child.id(), "job started");
    let st = child.wait();
    if let Some(r) = record {
        let _ = std::fs::remove_file(r);
    }
    let st = st.map_err(|e| format!("waiting for the job: {e}"))?;
    Ok(exit_code(st))
}

/// cr_run's exit status for the command's: its code, or 128 + its signal.
fn exit_code(st: std::process::ExitStatus) -> u8 {
    match (st.code(), st.signal()) {
        (Some(c), _) => c as u8,
        (None, Some(s)) => (128 + s) as u8,
        _ => 1,
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("CR_LOG"))
        .with_writer(std::io::stderr)
        .init();
    match run(Cli::parse()) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("cr_run: error: {e}");
            ExitCode::FAILURE
        }
    }
}
