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
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;

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
    /// On this signal (`USR1`, `SIGUSR1`, ...) checkpoint the job into
    /// --dir with `cr_checkpoint --kill`, so that it ends there and can be
    /// resumed with `cr_restart DIR` (Slurm: `--signal=B:USR1@SECS` before
    /// a time limit). A checkpoint that fails leaves the job running.
    #[arg(long, value_name = "SIGNAL", requires = "dir")]
    checkpoint_signal: Option<String>,
    /// With --checkpoint-signal: also store this file's content in the
    /// image (`cr_checkpoint --save-file`; repeatable), e.g. a batch script
    /// the scheduler removes when the job ends.
    #[arg(long, value_name = "PATH", requires = "checkpoint_signal")]
    checkpoint_save_file: Vec<PathBuf>,
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
    // Its thread is made before the PID namespace: once cr_run has
    // unshared it, the kernel refuses new threads (EINVAL from clone).
    let on_signal = match (cli.checkpoint_signal.as_deref(), &dir) {
        (Some(sig), Some(d)) => Some(checkpoint_on(
            parse_signal(sig)?,
            d,
            &cli.checkpoint_save_file,
        )?),
        _ => None,
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
    if let Some(w) = &on_signal {
        w.job.store(child.id() as i32, Ordering::SeqCst);
    }
    let st = child.wait();
    // A checkpoint on signal kills the job: let it say how it went.
    if let Some(w) = on_signal {
        if w.started.load(Ordering::SeqCst) {
            let _ = w.thread.join();
        }
    }
    if let Some(r) = record {
        let _ = std::fs::remove_file(r);
    }
    let st = st.map_err(|e| format!("waiting for the job: {e}"))?;
    Ok(exit_code(st))
}

/// A signal by name (`USR1`, `SIGUSR1`) or number.
fn parse_signal(s: &str) -> Result<i32, String> {
    if let Ok(n) = s.parse::<i32>() {
        return Ok(n);
    }
    let name = if s.starts_with("SIG") {
        s.to_string()
    } else {
        format!("SIG{s}")
    };
    name.parse::<nix::sys::signal::Signal>()
        .map(|sig| sig as i32)
        .map_err(|_| format!("bad --checkpoint-signal {s:?}: not a signal name"))
}

/// The watcher of `--checkpoint-signal`.
struct Watcher {
    /// The job's PID once started (0 before).
    job: Arc<AtomicI32>,
    /// Set when the signal came.
    started: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

/// Watches for `sig`: at the first one (once the job runs), runs
/// `cr_checkpoint --kill --dir DIR [--save-file F]... JOB` (next to
/// cr_run) and says on stderr what came of it.
fn checkpoint_on(sig: i32, dir: &std::path::Path, save: &[PathBuf]) -> Result<Watcher, String> {
    let mut signals = signal_hook::iterator::Signals::new([sig])
        .map_err(|e| format!("cannot watch signal {sig}: {e}"))?;
    let tool = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join("cr_checkpoint")))
        .unwrap_or_else(|| PathBuf::from("cr_checkpoint"));
    let dir = dir.to_path_buf();
    let save = save.to_vec();
    let job = Arc::new(AtomicI32::new(0));
    let started = Arc::new(AtomicBool::new(false));
    let (j, flag) = (job.clone(), started.clone());
    let thread = std::thread::spawn(move || {
        let pid = loop {
            if signals.forever().next().is_none() {
                return;
            }
            match j.load(Ordering::SeqCst) {
                0 => tracing::warn!(sig, "signal before the job started: ignored"),
                pid => break pid,
            }
        };
        flag.store(true, Ordering::SeqCst);
        tracing::info!(sig, pid, "checkpoint on signal");
        let out = Command::new(&tool)
            .args(["--kill", "--quiet", "--dir"])
            .arg(&dir)
            .args(
                save.iter()
                    .flat_map(|f| ["--save-file".as_ref(), f.as_os_str()]),
            )
            .arg(pid.to_string())
            .stdin(std::process::Stdio::null())
            .output();
        match out {
            Ok(o) if o.status.success() => eprintln!(
                "cr_run: signal {sig}: job checkpointed into {} and stopped (resume: cr_restart {})",
                dir.display(),
                dir.display()
            ),
            Ok(o) => eprintln!(
                "cr_run: error: signal {sig}: the checkpoint failed, the job runs on: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ),
            Err(e) => eprintln!(
                "cr_run: error: signal {sig}: cannot run {}: {e}; the job runs on",
                tool.display()
            ),
        }
    });
    Ok(Watcher {
        job,
        started,
        thread,
    })
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
