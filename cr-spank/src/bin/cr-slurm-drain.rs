//! `cr-slurm-drain`: moves checkpointable Slurm jobs off drained nodes by
//! checkpoint and requeue (docs/SLURM.md, Drain).
//!
//! Slurm 22.05 has no hook on a node entering DRAINING (`strigger
//! --drained` fires only once the node is idle, too late), and `scontrol
//! update state=drain` reaches neither slurmd nor the plugin; so one
//! watcher on a host with the Slurm commands and crctl's administrator
//! configuration polls both sides every `period` seconds:
//!
//! 1. nodes drained in the coordinator (`crctl drain X`) but not in Slurm
//!    are drained in Slurm (`scontrol update NodeName=X State=DRAIN`);
//! 2. every running job on a node drained in Slurm (`sinfo -t drain`,
//!    `squeue -w`) whose cluster job `slurm-JOBID` has a live member is
//!    sent the plugin's signal on its batch step (`scancel --batch
//!    --signal=USR1`): its cr_run checkpoints the whole job with `--kill`
//!    and holds its place, exactly as for a preemption;
//! 3. once that checkpoint is committed (a new last checkpoint, no live
//!    member), the job is requeued (`scontrol requeue`) and its start
//!    brought forward (`scontrol update StartTime=now`); Slurm starts it
//!    on an undrained node, where the plugin resumes it from that
//!    checkpoint.
//!
//! It keeps no state of its own beyond the jobs it already signalled (a
//! restart of the watcher signals a job at most once more, which its
//! cr_run ignores). A job whose checkpoint fails runs on where it is.

use clap::Parser;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The configuration file read when none is named.
const DEFAULT_CONFIG: &str = "/etc/cr/slurm-drain.toml";

/// How often a wait polls Slurm and the coordinator.
const POLL: Duration = Duration::from_millis(500);

/// Move checkpointable Slurm jobs off drained nodes (checkpoint, requeue).
#[derive(Parser)]
#[command(name = "cr-slurm-drain", version)]
struct Cli {
    /// Configuration file (TOML; keys as the long options, with `_`;
    /// default /etc/cr/slurm-drain.toml, if it exists).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Seconds between two looks at the nodes.
    #[arg(long)]
    period: Option<f64>,
    /// The plugin's checkpoint signal (its plugstack.conf `signal=`).
    #[arg(long)]
    signal: Option<String>,
    /// The crctl to run.
    #[arg(long)]
    crctl: Option<PathBuf>,
    /// crctl's configuration file (coordinator, administrator's certificate).
    #[arg(long)]
    crctl_config: Option<PathBuf>,
    /// How long a job's checkpoint may take before it is left where it is.
    #[arg(long, value_name = "SECS")]
    timeout: Option<u64>,
    /// One pass, then exit.
    #[arg(long)]
    once: bool,
}

/// The configuration file's keys (see [`Cli`]).
#[derive(serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    period: Option<f64>,
    signal: Option<String>,
    crctl: Option<PathBuf>,
    crctl_config: Option<PathBuf>,
    timeout: Option<u64>,
}

/// The settings in force (flags over the file over the defaults).
struct Settings {
    period: Duration,
    signal: String,
    crctl: PathBuf,
    crctl_config: Option<PathBuf>,
    timeout: Duration,
}

impl Settings {
    fn new(cli: &Cli) -> Result<Settings, String> {
        let f: FileConfig = match &cli.config {
            Some(path) => cr_rpc::config::load(path, true),
            None => cr_rpc::config::load(std::path::Path::new(DEFAULT_CONFIG), false),
        }
        .map_err(|e| e.to_string())?;
        let period = cli.period.or(f.period).unwrap_or(5.0);
        if !(period > 0.0 && period.is_finite()) {
            return Err(format!(
                "bad period {period}: must be a positive number of seconds"
            ));
        }
        Ok(Settings {
            period: Duration::from_secs_f64(period),
            signal: cli
                .signal
                .clone()
                .or(f.signal)
                .unwrap_or_else(|| "USR1".into()),
            crctl: cli
                .crctl
                .clone()
                .or(f.crctl)
                .unwrap_or_else(|| "crctl".into()),
            crctl_config: cli.crctl_config.clone().or(f.crctl_config),
            timeout: Duration::from_secs(cli.timeout.or(f.timeout).unwrap_or(120)),
        })
    }
}

/// A cluster job as the coordinator lists it.
struct ClusterJob {
    alive: bool,
    last_checkpoint: String,
}

/// The watcher (see the module docs).
struct Watcher {
    s: Settings,
    stop: Arc<AtomicBool>,
    /// Slurm jobs signalled, while they run on a drained node.
    signalled: HashSet<u32>,
}

/// Runs `exe args...` to its end: its stdout, or one line saying why not.
fn run(exe: &std::path::Path, args: &[&str]) -> Result<String, String> {
    let out = Command::new(exe)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", exe.display()))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(format!(
            "{} {}: {}",
            exe.display(),
            args.join(" "),
            err.lines().last().unwrap_or("failed").trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A Slurm command.
fn slurm(args: &[&str]) -> Result<String, String> {
    let (exe, rest) = args.split_first().expect("a command");
    run(std::path::Path::new(exe), rest)
}

/// Slurm's state of job `id` (`RUNNING`, `PENDING`, ...; "" if unknown).
fn job_state(id: u32) -> String {
    slurm(&["scontrol", "show", "job", "-o", &id.to_string()])
        .unwrap_or_default()
        .split_whitespace()
        .find_map(|w| w.strip_prefix("JobState="))
        .unwrap_or("")
        .to_string()
}

/// The words of a command's output (node names, job ids), deduplicated.
fn words(out: &str) -> BTreeSet<String> {
    out.split_whitespace().map(str::to_string).collect()
}

impl Watcher {
    /// `crctl --json ARGS...` as JSON.
    fn crctl(&self, args: &[&str]) -> Result<serde_json::Value, String> {
        let mut a: Vec<&str> = Vec::new();
        let cfg;
        if let Some(c) = &self.s.crctl_config {
            cfg = c.to_string_lossy().into_owned();
            a.extend(["--config", &cfg]);
        }
        a.push("--json");
        a.extend_from_slice(args);
        let out = run(&self.s.crctl, &a)?;
        serde_json::from_str(&out).map_err(|e| format!("crctl {}: bad JSON: {e}", args.join(" ")))
    }

    /// The coordinator's jobs by name.
    fn cluster_jobs(&self) -> Result<BTreeMap<String, ClusterJob>, String> {
        let v = self.crctl(&["jobs"])?;
        let list = |v: &serde_json::Value, k: &str| {
            v.get(k)
                .and_then(|l| l.as_array())
                .cloned()
                .unwrap_or_default()
        };
        let text = |v: &serde_json::Value, k: &str| {
            v.get(k).and_then(|s| s.as_str()).unwrap_or("").to_string()
        };
        Ok(list(&v, "jobs")
            .iter()
            .map(|j| {
                let alive = list(j, "procs")
                    .iter()
                    .any(|p| p.get("alive").and_then(|a| a.as_bool()) == Some(true));
                (
                    text(j, "name"),
                    ClusterJob {
                        alive,
                        last_checkpoint: text(j, "last_checkpoint"),
                    },
                )
            })
            .collect())
    }

    /// Nodes drained in the coordinator.
    fn coordinator_drained(&self) -> Result<BTreeSet<String>, String> {
        let v = self.crctl(&["nodes"])?;
        Ok(v.get("nodes")
            .and_then(|l| l.as_array())
            .into_iter()
            .flatten()
            .filter(|n| n.get("drained").and_then(|d| d.as_bool()) == Some(true))
            .filter_map(|n| n.get("name").and_then(|s| s.as_str()).map(str::to_string))
            .collect())
    }

    /// Sleeps `d` unless told to stop; false when told to stop.
    fn pause(&self, d: Duration) -> bool {
        let until = Instant::now() + d;
        while Instant::now() < until {
            if self.stop.load(Ordering::SeqCst) {
                return false;
            }
            std::thread::sleep(POLL.min(until.saturating_duration_since(Instant::now())));
        }
        !self.stop.load(Ordering::SeqCst)
    }

    /// One look at the nodes (see the module docs).
    fn tick(&mut self) -> Result<(), String> {
        let mut drained = words(&slurm(&["sinfo", "-h", "-N", "-t", "drain", "-o", "%N"])?);
        for node in self.coordinator_drained()? {
            if drained.contains(&node) {
                continue;
            }
            let reason = format!("Reason=crctl drain {node} (cr-slurm-drain)");
            match slurm(&[
                "scontrol",
                "update",
                &format!("NodeName={node}"),
                "State=DRAIN",
                &reason,
            ]) {
                Ok(_) => {
                    tracing::info!(node, "drained by crctl: drained in Slurm too");
                    drained.insert(node);
                }
                Err(e) => tracing::warn!(node, "cannot drain it in Slurm: {e}"),
            }
        }
        if drained.is_empty() {
            self.signalled.clear();
            return Ok(());
        }
        let nodes = drained.iter().cloned().collect::<Vec<_>>().join(",");
        let running: BTreeSet<u32> = words(&slurm(&[
            "squeue", "-h", "-t", "RUNNING", "-w", &nodes, "-o", "%i",
        ])?)
        .iter()
        .filter_map(|w| w.parse().ok())
        .collect();
        self.signalled.retain(|id| running.contains(id));
        let jobs = self.cluster_jobs()?;
        let mut waiting = Vec::new();
        for &id in &running {
            let name = format!("slurm-{id}");
            let Some(j) = jobs.get(&name).filter(|j| j.alive) else {
                continue;
            };
            if !self.signalled.insert(id) {
                continue;
            }
            let sig = format!("--signal={}", self.s.signal);
            match slurm(&["scancel", "--batch", &sig, &id.to_string()]) {
                Ok(_) => {
                    tracing::info!(
                        job = id,
                        nodes = %nodes,
                        "on a drained node: checkpoint (signal {})",
                        self.s.signal
                    );
                    waiting.push((id, name, j.last_checkpoint.clone()));
                }
                Err(e) => tracing::warn!(job = id, "cannot signal it: {e}; it runs on"),
            }
        }
        self.requeue_checkpointed(waiting)
    }

    /// Waits for the checkpoint of each signalled job (`(id, cluster job,
    /// last checkpoint before)`), then requeues it.
    fn requeue_checkpointed(&self, mut waiting: Vec<(u32, String, String)>) -> Result<(), String> {
        let deadline = Instant::now() + self.s.timeout;
        while !waiting.is_empty() {
            let jobs = self.cluster_jobs()?;
            let mut left = Vec::new();
            for (id, name, before) in waiting {
                match jobs.get(&name) {
                    Some(j) if !j.alive && j.last_checkpoint != before => {
                        self.requeue(id, &j.last_checkpoint)
                    }
                    _ if job_state(id) != "RUNNING" => tracing::warn!(
                        job = id,
                        "ended before its checkpoint was seen (a --checkpoint-dir job ends after \
                         its checkpoint: resume it with --restart-from): not requeued"
                    ),
                    _ if Instant::now() >= deadline => tracing::warn!(
                        job = id,
                        "no checkpoint within {:?}: it runs on where it is",
                        self.s.timeout
                    ),
                    _ => left.push((id, name, before)),
                }
            }
            waiting = left;
            if !waiting.is_empty() && !self.pause(POLL) {
                break;
            }
        }
        Ok(())
    }

    /// Requeues job `id`, checkpointed as `ck`, and brings its start
    /// forward (a requeued job waits for its BeginTime otherwise).
    fn requeue(&self, id: u32, ck: &str) {
        if let Err(e) = slurm(&["scontrol", "requeue", &id.to_string()]) {
            tracing::warn!(job = id, "checkpointed as {ck}, but cannot requeue it: {e}");
            return;
        }
        let deadline = Instant::now() + self.s.timeout;
        while job_state(id) != "PENDING" {
            if Instant::now() >= deadline || !self.pause(POLL) {
                tracing::warn!(
                    job = id,
                    "requeued, but not pending within {:?}",
                    self.s.timeout
                );
                return;
            }
        }
        if let Err(e) = slurm(&[
            "scontrol",
            "update",
            &format!("JobId={id}"),
            "StartTime=now",
        ]) {
            tracing::warn!(job = id, "cannot bring its start forward: {e}");
        }
        tracing::info!(
            job = id,
            checkpoint = ck,
            "checkpointed and requeued: it resumes elsewhere"
        );
    }
}

fn main() -> ExitCode {
    cr_rpc::logging::init_daemon();
    let cli = Cli::parse();
    let s = match Settings::new(&cli) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("cr-slurm-drain: error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        if let Err(e) = signal_hook::flag::register(sig, stop.clone()) {
            eprintln!("cr-slurm-drain: error: cannot handle signal {sig}: {e}");
            return ExitCode::FAILURE;
        }
    }
    let period = s.period;
    let mut w = Watcher {
        s,
        stop,
        signalled: HashSet::new(),
    };
    tracing::info!(period = ?period, "watching drained nodes");
    loop {
        if let Err(e) = w.tick() {
            if cli.once {
                eprintln!("cr-slurm-drain: error: {e}");
                return ExitCode::FAILURE;
            }
            tracing::warn!("{e}");
        }
        if cli.once || !w.pause(period) {
            break;
        }
    }
    tracing::info!("stopped");
    ExitCode::SUCCESS
}
