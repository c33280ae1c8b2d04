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
//! `--checkpoint-signal` then checkpoints the whole job through the
//! coordinator (`cr_checkpoint --job NAME --kill`), `--resume` restarts the
//! job's last committed checkpoint on this node instead of starting the
//! command (a batch job requeued after such a checkpoint), `--resume-from`
//! restarts a given checkpoint of it (`sbatch --restart-from=slurm-N`), and
//! `--interval` sets its periodic checkpoints.
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
    /// On this signal (`USR1`, `SIGUSR1`, ...) checkpoint the job and stop
    /// it: with --dir, into that directory with `cr_checkpoint --kill`, to
    /// be resumed with `cr_restart DIR` (Slurm: `--signal=B:USR1@SECS`
    /// before a time limit); else, with --job, the whole cluster job through
    /// the coordinator (`cr_checkpoint --job NAME --kill`), to be resumed
    /// with --resume. A checkpoint that fails leaves the job running.
    #[arg(long, value_name = "SIGNAL")]
    checkpoint_signal: Option<String>,
    /// After a checkpoint on --checkpoint-signal stopped the job, stay
    /// until told to end (SIGTERM, SIGINT, SIGHUP) instead of exiting, so
    /// that a batch system decides what becomes of the job (Slurm requeues
    /// a preempted job at the end of its grace time).
    #[arg(long, requires = "checkpoint_signal")]
    hold: bool,
    /// Also store this file's content in every image of the job
    /// (repeatable), e.g. a batch script the scheduler removes when the job
    /// ends: with --checkpoint-signal and --dir, in that image; with --job,
    /// in every image of this member.
    #[arg(long, value_name = "PATH")]
    checkpoint_save_file: Vec<PathBuf>,
    /// With --job: if the job has a committed checkpoint, restart it on
    /// this node (through the coordinator) instead of running the command,
    /// wait for it and exit with its status; else run the command.
    #[arg(long, requires = "job")]
    resume: bool,
    /// With --job: restart the job on this node from CHECKPOINT (one of
    /// its checkpoint ids, or the job's name: its latest committed one)
    /// instead of running the command, wait for it and exit with its
    /// status; fails with one line if there is no such checkpoint (Slurm:
    /// `sbatch --restart-from=slurm-N`).
    #[arg(
        long,
        value_name = "CHECKPOINT",
        requires = "job",
        conflicts_with = "resume"
    )]
    resume_from: Option<String>,
    /// With --resume or --resume-from: restart the job over these nodes
    /// (repeatable; this node first), the i-th node of the checkpoint
    /// (its nodes in host-list order: n9 before n10) onto the i-th
    /// (modulo their number):
    /// a multi-node job resumed over a new allocation (Slurm: the
    /// requeued job's nodes). Default: all onto this node. cr_run waits
    /// for the trees restored on the first.
    #[arg(long, value_name = "NODE", requires = "job")]
    on: Vec<String>,
    /// With --job: checkpoint the job every SECS seconds (the coordinator's
    /// periodic checkpoints, as `crctl job NAME --interval SECS`).
    #[arg(long, value_name = "SECS", requires = "job")]
    interval: Option<u32>,
    /// With --job: serve the job's `srun` stand-ins on this node (a Slurm
    /// batch step: `cr_srun --cr-launcher JOB`, next to cr_run, runs the
    /// real srun of each step outside the job; docs/SLURM.md).
    #[arg(long, requires = "job")]
    srun_launcher: bool,
    /// Write the job's PID (as seen from here) to this file.
    #[arg(long)]
    pid_file: Option<PathBuf>,
    /// The command and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<OsString>,
}

fn run(cli: Cli) -> Result<u8, String> {
    if cli.checkpoint_signal.is_some() && cli.dir.is_none() && cli.job.is_none() {
        return Err("--checkpoint-signal needs --dir or --job (where the checkpoint goes)".into());
    }
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
    let save: Vec<PathBuf> = cli
        .checkpoint_save_file
        .iter()
        .map(|f| std::path::absolute(f).map_err(|e| format!("bad file {}: {e}", f.display())))
        .collect::<Result<_, _>>()?;
    // A process of its own, made before the PID namespace (the real sruns
    // it starts must not be in the job's), dying with cr_run.
    if let (true, Some(job)) = (cli.srun_launcher, &cli.job) {
        start_srun_launcher(job);
    }
    // Its thread is made before the PID namespace: once cr_run has
    // unshared it, the kernel refuses new threads (EINVAL from clone).
    let on_signal = match (cli.checkpoint_signal.as_deref(), &dir, &cli.job) {
        (Some(sig), Some(d), _) => Some((Target::Dir(d.clone(), save.clone()), sig)),
        (Some(sig), None, Some(job)) => Some((Target::Job(job.clone()), sig)),
        _ => None,
    }
    .map(|(target, sig)| checkpoint_on(parse_signal(sig)?, target, cli.hold))
    .transpose()?;
    if let (Some(a), Some(job), Some(from)) = (agent.as_mut(), &cli.job, &cli.resume_from) {
        let req = cr_rpc::pb::RestartRequest {
            job: job.clone(),
            checkpoint: if from == job { "" } else { from }.to_string(),
            on: cli.on.clone(),
            ..Default::default()
        };
        let r = a.restart_job_required(req).map_err(|e| {
            if from == job {
                format!("cannot resume job {job}: {e}")
            } else {
                format!("cannot resume job {job} from {from}: {e}")
            }
        })?;
        set_interval(a, job, cli.interval);
        return resumed(a, job, &r, cli.on.first(), on_signal);
    }
    if let (Some(a), Some(job), true) = (agent.as_mut(), &cli.job, cli.resume) {
        let req = cr_rpc::pb::RestartRequest {
            job: job.clone(),
            on: cli.on.clone(),
            ..Default::default()
        };
        if let Some(r) = a
            .restart_job(req)
            .map_err(|e| format!("cannot resume job {job}: {e}"))?
        {
            set_interval(a, job, cli.interval);
            return resumed(a, job, &r, cli.on.first(), on_signal);
        }
        tracing::info!(job, "no checkpoint to resume from: the command starts");
    }
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
    // Recorded for cr_run itself first: the job runs (and may be named to
    // cr_checkpoint) before its own record below is written.
    let own_record = dir
        .as_deref()
        .and_then(|d| cr_engine::capture::record_job(std::process::id() as i32, d));
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
        let files: Vec<String> = save
            .iter()
            .map(|f| f.to_string_lossy().into_owned())
            .collect();
        if let Err(e) = a.join(job, child.id() as i32, &files) {
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
    if let (Some(a), Some(job)) = (agent.as_mut(), &cli.job) {
        set_interval(a, job, cli.interval);
    }
    let st = child.wait();
    // A checkpoint on signal kills the job: let it say how it went.
    if let Some(w) = on_signal {
        w.finish();
    }
    for r in [record, own_record].into_iter().flatten() {
        let _ = std::fs::remove_file(r);
    }
    let st = st.map_err(|e| format!("waiting for the job: {e}"))?;
    Ok(exit_code(st))
}

/// `--srun-launcher`: starts `cr_srun --cr-launcher JOB` (next to cr_run),
/// killed when cr_run ends; a failure is said (the job's srun steps then
/// run inside it and cannot be checkpointed while they run).
fn start_srun_launcher(job: &str) {
    let tool = sibling("cr_srun");
    let mut cmd = Command::new(&tool);
    cmd.args(["--cr-launcher", job])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped());
    cr_sys::clone::kill_with_parent(&mut cmd, libc::SIGKILL);
    let ready = cmd.spawn().and_then(|mut c| {
        // Its `ready` once it listens (EOF: it failed, and said why).
        let mut line = String::new();
        let out = c.stdout.take().ok_or(std::io::ErrorKind::BrokenPipe)?;
        std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line)?;
        match line.trim() {
            "ready" => Ok(()),
            _ => Err(std::io::Error::other("it did not start")),
        }
    });
    if let Err(e) = ready {
        eprintln!(
            "cr_run: error: cannot run {} --cr-launcher: {e}; the job's srun steps cannot be \
             checkpointed",
            tool.display()
        );
    }
}

/// The program `name` next to cr_run (else on PATH).
fn sibling(name: &str) -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join(name)))
        .unwrap_or_else(|| PathBuf::from(name))
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

/// Where a checkpoint on signal goes.
enum Target {
    /// This directory, with these files' contents (`cr_checkpoint --dir`).
    Dir(PathBuf, Vec<PathBuf>),
    /// The whole cluster job, through the coordinator.
    Job(String),
}

/// The watcher of `--checkpoint-signal`.
struct Watcher {
    /// The job's PID once started (0 before).
    job: Arc<AtomicI32>,
    /// Set when the signal came.
    started: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl Watcher {
    /// Once the job ended: if the signal came, let the watcher say how its
    /// checkpoint went (with --hold it then waits to be told to end).
    fn finish(self) {
        if self.started.load(Ordering::SeqCst) {
            let _ = self.thread.join();
        }
    }
}

/// Watches for `sig`: at the first one (once the job runs), checkpoints
/// the job into `target` with `--kill` (`cr_checkpoint`, next to cr_run)
/// and says on stderr what came of it; with `hold`, after a checkpoint
/// that stopped the job, waits for SIGTERM, SIGINT or SIGHUP and exits.
fn checkpoint_on(sig: i32, target: Target, hold: bool) -> Result<Watcher, String> {
    let mut signals = signal_hook::iterator::Signals::new([sig])
        .map_err(|e| format!("cannot watch signal {sig}: {e}"))?;
    let tool = sibling("cr_checkpoint");
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
        let mut cmd = Command::new(&tool);
        cmd.args(["--kill", "--quiet"]);
        let (into, resume) = match &target {
            Target::Dir(dir, save) => {
                cmd.arg("--dir").arg(dir);
                for f in save {
                    cmd.arg("--save-file").arg(f);
                }
                cmd.arg(pid.to_string());
                (
                    format!("into {}", dir.display()),
                    format!("cr_restart {}", dir.display()),
                )
            }
            Target::Job(name) => {
                cmd.arg("--job").arg(name);
                (
                    format!("(cluster job {name})"),
                    format!("cr_run --job {name} --resume"),
                )
            }
        };
        let out = cmd.stdin(std::process::Stdio::null()).output();
        let ok = match out {
            Ok(o) if o.status.success() => {
                eprintln!(
                    "cr_run: signal {sig}: job checkpointed {into} and stopped (resume: {resume})"
                );
                true
            }
            Ok(o) => {
                eprintln!(
                    "cr_run: error: signal {sig}: the checkpoint failed, the job runs on: {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                );
                false
            }
            Err(e) => {
                eprintln!(
                    "cr_run: error: signal {sig}: cannot run {}: {e}; the job runs on",
                    tool.display()
                );
                false
            }
        };
        if ok && hold {
            hold_until_told();
        }
    });
    Ok(Watcher {
        job,
        started,
        thread,
    })
}

/// `--hold`: stay until SIGTERM, SIGINT or SIGHUP, then exit 128 + it.
fn hold_until_told() {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    match signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP]) {
        Ok(mut s) => {
            tracing::info!("job stopped by its checkpoint: holding until told to end");
            let sig = s.forever().next().unwrap_or(SIGTERM);
            std::process::exit(128 + sig);
        }
        Err(e) => tracing::warn!(error = %e, "cannot wait for the end: exiting"),
    }
}

/// `--interval`: the job's periodic checkpoints (a failure is said, and
/// the job runs without them).
fn set_interval(agent: &mut cr_rpc::local::Agent, job: &str, secs: Option<u32>) {
    let Some(secs) = secs else { return };
    let req = cr_rpc::pb::ConfigureRequest {
        job: job.to_string(),
        interval_secs: Some(secs),
        ..Default::default()
    };
    if let Err(e) = agent.configure_job(req) {
        eprintln!("cr_run: error: cannot set periodic checkpoints of job {job}: {e}");
    }
}

/// `--resume` found a checkpoint: the job was restarted (`r`), here or
/// (`here`: this node's name, the first `--on`) over several nodes; wait
/// for its trees on this node and exit with the first one's status. A
/// SIGTERM, SIGINT or SIGHUP kills them (as it kills a job cr_run started;
/// the trees on other nodes end with the ones here that started them,
/// through cr_rsh).
fn resumed(
    agent: &mut cr_rpc::local::Agent,
    job: &str,
    r: &cr_rpc::pb::RestartReply,
    here: Option<&String>,
    on_signal: Option<Watcher>,
) -> Result<u8, String> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let pids: Vec<i32> = r
        .procs
        .iter()
        .filter(|p| here.is_none_or(|n| *n == p.node))
        .map(|p| p.pid)
        .collect();
    // One write: the resumed job already runs and may write to the same
    // file (a batch job's output), and eprintln! of a formatted line is
    // several writes on the unbuffered stderr.
    let line = format!(
        "cr_run: job {job} resumed from {} ({} trees, {} ms{})\n",
        r.checkpoint,
        pids.len(),
        r.duration_ms,
        moves(&r.placed)
    );
    let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
    if let Some(w) = &on_signal {
        w.job
            .store(pids.first().copied().unwrap_or(0), Ordering::SeqCst);
    }
    let mut ends = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP])
        .map_err(|e| format!("cannot watch for the end: {e}"))?;
    let roots = pids.clone();
    std::thread::spawn(move || {
        if let Some(sig) = ends.forever().next() {
            for &p in &roots {
                // The root of its own PID namespace: only SIGKILL gets
                // through from here, and it ends the whole namespace.
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(p),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            std::process::exit(128 + sig);
        }
    });
    let mut first = None;
    for &p in &pids {
        let st = agent
            .wait(p)
            .map_err(|e| format!("waiting for the resumed job: {e}"))?;
        first.get_or_insert(st);
    }
    if let Some(w) = on_signal {
        w.finish();
    }
    Ok(first.unwrap_or(0).clamp(0, 255) as u8)
}

/// `; nodes OLD->NEW, ...` for the nodes a restart moved (`placed`:
/// `OLD_NODE:OLD_PID=NEW_NODE:NEW_PID`), each once, in their order; empty
/// when none moved.
fn moves(placed: &[String]) -> String {
    let node = |s: &str| s.rsplit_once(':').map_or(s, |(n, _)| n).to_string();
    let mut pairs: Vec<String> = Vec::new();
    for (old, new) in placed.iter().filter_map(|p| p.split_once('=')) {
        let (old, new) = (node(old), node(new));
        let pair = format!("{old}->{new}");
        if old != new && !pairs.contains(&pair) {
            pairs.push(pair);
        }
    }
    if pairs.is_empty() {
        return String::new();
    }
    format!("; nodes {}", pairs.join(", "))
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
