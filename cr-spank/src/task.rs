//! In each task of a checkpointable job, just before Slurm execs it: run
//! it under `cr_run --job slurm-JOBID` instead (the plugin execs cr_run
//! itself, with the task's command line and environment), or, when the
//! node's agent cannot be reached, let it run as it is and say so.

use crate::config::Config;
use crate::{OPT_CHECKPOINT, OPT_CHECKPOINT_DIR, OPT_RESTART_FROM};
use cr_sys::spank::Spank;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::process::Command;

/// The step id of a batch script (`SLURM_BATCH_SCRIPT`).
const BATCH_STEP: u32 = 0xffff_fffb;
/// In a task of a step started by the batch script's srun stand-in
/// (`cr_srun`): where it listens, `ADDR[,ADDR...] PORT`.
const RELAY_ENV: &str = "CR_SRUN_RELAY";

/// `word` quoted for `sh -c` (single quotes; a `'` as `'\''`).
pub fn sh_quote(word: &str) -> String {
    format!("'{}'", word.replace('\'', "'\\''"))
}

/// The command of a task of a step whose stand-in is `cr_srun`:
/// `cr_rsh --cr-serve-task ADDRS PORT 'ARGV'...` (it connects back to the
/// stand-in, runs ARGV with `sh -c` and relays its stdio and status); None
/// if `relay` is not `ADDRS PORT`.
pub fn relayed(cr_rsh: &std::path::Path, relay: &str, argv: &[String]) -> Option<Vec<String>> {
    let (addrs, port) = relay.trim().split_once(' ')?;
    port.parse::<u16>().ok()?;
    let words: Vec<String> = argv.iter().map(|w| sh_quote(w)).collect();
    Some(vec![
        cr_rsh.to_string_lossy().into_owned(),
        "--cr-serve-task".into(),
        addrs.to_string(),
        port.to_string(),
        words.join(" "),
    ])
}

/// The cluster job of Slurm job `id`.
pub fn job_name(id: u32) -> String {
    format!("slurm-{id}")
}

/// What `--restart-from=CHECKPOINT` names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RestartFrom {
    /// A directory written by a checkpoint on signal of a job made with
    /// `--checkpoint-dir` (`cr_restart DIR`).
    Dir(String),
    /// A checkpoint of cluster job `job` (`slurm-N`): `checkpoint` is one
    /// of its ids (`slurm-N-K`, as `crctl checkpoints` lists them), None
    /// for its latest committed one.
    Job {
        job: String,
        checkpoint: Option<String>,
    },
}

/// Parses `--restart-from`: `slurm-N` (that job's last committed
/// checkpoint), `slurm-N-K` (that checkpoint), else a directory.
pub fn parse_restart_from(v: &str) -> Result<RestartFrom, String> {
    if v.is_empty() {
        return Err(
            "CHECKPOINT must be slurm-JOBID, a checkpoint id (slurm-JOBID-N) or a \
                    directory"
                .into(),
        );
    }
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if let Some(rest) = v.strip_prefix("slurm-") {
        match rest.split_once('-') {
            None if digits(rest) => {
                return Ok(RestartFrom::Job {
                    job: v.to_string(),
                    checkpoint: None,
                })
            }
            Some((id, k)) if digits(id) && digits(k) => {
                return Ok(RestartFrom::Job {
                    job: format!("slurm-{id}"),
                    checkpoint: Some(v.to_string()),
                })
            }
            _ => {}
        }
    }
    Ok(RestartFrom::Dir(v.to_string()))
}

/// `--checkpoint`'s INTERVAL: empty (none), seconds, or a number with
/// `s`, `m`, `h`.
pub fn parse_interval(v: &str) -> Result<Option<u64>, String> {
    let v = v.trim();
    if v.is_empty() {
        return Ok(None);
    }
    let (num, mult) = match v.char_indices().last() {
        Some((i, 's')) => (&v[..i], 1),
        Some((i, 'm')) => (&v[..i], 60),
        Some((i, 'h')) => (&v[..i], 3600),
        _ => (v, 1),
    };
    match num.parse::<u64>() {
        Ok(n) if n > 0 => Ok(Some(n * mult)),
        _ => Err("INTERVAL must be a positive number of seconds (or 10m, 2h)".into()),
    }
}

/// One line on the task's stderr (the job's output), prefixed `cr_spank: `.
fn say(msg: &str) {
    let _ = writeln!(std::io::stderr(), "cr_spank: {msg}");
}

/// The node's name: `SLURMD_NODENAME` of the task's environment, else the
/// host name.
fn node_name(env: &[String]) -> String {
    env.iter()
        .find_map(|e| e.strip_prefix("SLURMD_NODENAME="))
        .map(str::to_string)
        .unwrap_or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|s| s.trim().to_string())
                .unwrap_or_default()
        })
}

/// How often Slurm requeued the job: `SLURM_RESTART_COUNT` of the task's
/// environment or `S_SLURM_RESTART_COUNT` (22.05 gives 0 there in a
/// requeued batch step), whichever is larger; 0 for a first run.
fn restart_count(sp: &Spank, env: &[String]) -> u32 {
    let from_env = env
        .iter()
        .find_map(|e| e.strip_prefix("SLURM_RESTART_COUNT="))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    sp.restart_count().unwrap_or(0).max(from_env)
}

/// The job's nodes in allocation order (`SLURM_JOB_NODELIST`), this node
/// (`node`, the batch step's) first; empty if it cannot be told (then
/// the job resumes on this node alone).
fn allocation(env: &[String], node: &str) -> Vec<String> {
    let Some(list) = env
        .iter()
        .find_map(|e| e.strip_prefix("SLURM_JOB_NODELIST="))
    else {
        return Vec::new();
    };
    match crate::hostlist::expand(list) {
        Ok(mut nodes) if nodes.iter().any(|n| n == node) => {
            nodes.retain(|n| n != node);
            nodes.insert(0, node.to_string());
            nodes
        }
        Ok(_) => Vec::new(),
        Err(e) => {
            say(&format!(
                "SLURM_JOB_NODELIST: {e}: the job resumes on {node} alone"
            ));
            Vec::new()
        }
    }
}

/// `exe` with exactly the task's environment (`NAME=VALUE` strings): what
/// slurmstepd would have given the task.
fn task_command(exe: &std::path::Path, env: &[String]) -> Command {
    let mut cmd = Command::new(exe);
    cmd.env_clear();
    for e in env {
        if let Some((k, v)) = e.split_once('=') {
            cmd.env(k, v);
        }
    }
    cmd
}

/// `slurm_spank_task_init` (see the module docs). Only errors of Slurm's
/// interface fail the task; anything about cr leaves it running without
/// checkpoints.
pub fn wrap(sp: &Spank, cfg: &Config) -> Result<(), String> {
    let ck = sp.getopt(&OPT_CHECKPOINT).map_err(|e| e.to_string())?;
    let dir = sp.getopt(&OPT_CHECKPOINT_DIR).map_err(|e| e.to_string())?;
    let from = sp.getopt(&OPT_RESTART_FROM).map_err(|e| e.to_string())?;
    if ck.is_none() && dir.is_none() && from.is_none() {
        return Ok(());
    }
    let id = sp.job_id().map_err(|e| e.to_string())?;
    let batch = sp.step_id().map_err(|e| e.to_string())? == BATCH_STEP;
    let mut argv = sp.argv().map_err(|e| e.to_string())?;
    let mut env = sp.env().map_err(|e| e.to_string())?;
    let from = from
        .map(|f| parse_restart_from(&f).map_err(|e| format!("cr_spank: --restart-from={f}: {e}")))
        .transpose()?;
    // A job resumed from a cluster job's checkpoint goes on as that job
    // (its periodic and signal checkpoints, the members of its srun steps).
    let job = match &from {
        Some(RestartFrom::Job { job, .. }) => job.clone(),
        _ => job_name(id),
    };
    // In the batch step: what its cr_run resumes from instead of running
    // the script.
    let resume_from = match (&from, batch) {
        (Some(RestartFrom::Dir(d)), true) => return restart(id, d, cfg, &env),
        // Requeued after it resumed: from the job's latest checkpoint.
        (Some(RestartFrom::Job { job, checkpoint }), true) => Some(
            checkpoint
                .clone()
                .filter(|_| restart_count(sp, &env) == 0)
                .unwrap_or_else(|| job.clone()),
        ),
        _ => None,
    };
    let node = node_name(&env);
    let socket = cfg.socket_of(&node);
    if let Err(e) = std::os::unix::net::UnixStream::connect(&socket) {
        if let Some(r) = &resume_from {
            // Running the script instead would start the job over.
            return Err(format!(
                "cr_spank: job {id} cannot resume from {r}: cannot reach the cr agent of {node} \
                 at {} ({e})",
                socket.display()
            ));
        }
        say(&format!(
            "job {id} is NOT checkpointable: cannot reach the cr agent of {node} at {} ({e}); \
             it runs without checkpoints",
            socket.display()
        ));
        return Ok(());
    }
    if argv.is_empty() {
        return Err(format!("cr_spank: job {id}: the task has no command line"));
    }
    let dir = dir
        .filter(|d| !d.is_empty())
        .or_else(|| cfg.dir.clone())
        .map(|d| d.replace("%j", &id.to_string()));
    // A task of a step of the batch script's srun stand-in: it relays
    // through a connection back to it (which a checkpoint captures).
    let relay = env
        .iter()
        .find_map(|e| e.strip_prefix(&format!("{RELAY_ENV}=")))
        .map(str::to_string);
    if let (Some(r), false) = (relay, batch) {
        env.retain(|e| !e.starts_with(&format!("{RELAY_ENV}=")));
        match relayed(&cfg.cr_rsh, &r, &argv) {
            Some(a) => argv = a,
            None => say(&format!(
                "job {id}: bad {RELAY_ENV} {r:?}: the task runs unrelayed"
            )),
        }
    }
    // The batch script's srun steps go through the stand-in (cr_srun, as
    // `srun` first on its PATH) when the whole cluster job is checkpointed.
    let stand_in = batch && dir.is_none() && cfg.srun_dir.join("srun").exists();
    if stand_in {
        let dir = cfg.srun_dir.to_string_lossy();
        match env.iter_mut().find(|e| e.starts_with("PATH=")) {
            Some(p) => *p = format!("PATH={dir}:{}", &p[5..]),
            None => env.push(format!("PATH={dir}:/usr/bin:/bin")),
        }
    }
    let mut cmd = task_command(&cfg.cr_run, &env);
    cmd.arg("--job").arg(&job);
    if stand_in {
        cmd.arg("--srun-launcher");
    }
    if let Some(d) = &dir {
        cmd.arg("--dir").arg(d);
    }
    if batch {
        // The signal checkpoints into the directory (time limits), else
        // the whole cluster job, then holds the job's place until Slurm
        // ends it (a preemption requeues it then).
        cmd.arg("--checkpoint-signal").arg(&cfg.signal);
        if dir.is_none() {
            cmd.arg("--hold");
        }
        // slurmd removes the script when the job ends; the shell still
        // reads it: its content goes into the images.
        cmd.arg("--checkpoint-save-file").arg(&argv[0]);
        let resuming = if let Some(r) = &resume_from {
            say(&format!("job {id} resumes from {r}"));
            cmd.arg("--resume-from").arg(r);
            true
        } else if dir.is_none() && restart_count(sp, &env) > 0 {
            // A requeued job goes on from its last committed checkpoint.
            cmd.arg("--resume");
            true
        } else {
            false
        };
        if resuming {
            // Spread over this job's nodes (a multi-node job's members go
            // to the nodes Slurm gave this run).
            for n in allocation(&env, &node) {
                cmd.arg("--on").arg(n);
            }
        }
        if let Some(secs) = ck.as_deref().and_then(|v| parse_interval(v).ok().flatten()) {
            cmd.arg("--interval").arg(secs.to_string());
        }
    }
    cmd.arg("--").args(&argv);
    cmd.env("CR_AGENT_SOCKET", &socket)
        .env("CR_SLURM_JOB", &job);
    // exec only returns on failure.
    let err = cmd.exec();
    say(&format!(
        "job {id} is NOT checkpointable: cannot run {} ({err}); it runs without checkpoints",
        cfg.cr_run.display()
    ));
    Ok(())
}

/// The batch step of `--restart-from=FROM`: exec `cr_restart FROM` (the
/// job goes on from its checkpoint; cr_restart exits with its status).
fn restart(id: u32, from: &str, cfg: &Config, env: &[String]) -> Result<(), String> {
    let socket = cfg.socket_of(&node_name(env));
    say(&format!("job {id} resumes from {from}"));
    let mut cmd = task_command(&cfg.cr_restart, env);
    cmd.arg(from).env("CR_AGENT_SOCKET", &socket);
    let err = cmd.exec();
    // Running the script instead would start the job over: fail the task.
    Err(format!(
        "cr_spank: job {id}: cannot run {} to resume from {from}: {err}",
        cfg.cr_restart.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals() {
        assert_eq!(parse_interval(""), Ok(None));
        assert_eq!(parse_interval("30"), Ok(Some(30)));
        assert_eq!(parse_interval("10m"), Ok(Some(600)));
        assert_eq!(parse_interval("2h"), Ok(Some(7200)));
        assert!(parse_interval("0").is_err());
        assert!(parse_interval("x").is_err());
    }

    #[test]
    fn relayed_tasks() {
        let rsh = std::path::Path::new("/b/cr_rsh");
        let argv = ["sh".to_string(), "-c".into(), "echo 'a b' $X".into()];
        let a = relayed(rsh, "10.0.0.1,10.0.0.2 4242", &argv).expect("relayed");
        assert_eq!(
            a,
            [
                "/b/cr_rsh",
                "--cr-serve-task",
                "10.0.0.1,10.0.0.2",
                "4242",
                r#"'sh' '-c' 'echo '\''a b'\'' $X'"#
            ]
        );
        assert_eq!(relayed(rsh, "10.0.0.1", &argv), None);
        assert_eq!(relayed(rsh, "10.0.0.1 x", &argv), None);
    }

    #[test]
    fn restart_from() {
        let job = |j: &str, c: Option<&str>| RestartFrom::Job {
            job: j.into(),
            checkpoint: c.map(str::to_string),
        };
        assert_eq!(parse_restart_from("slurm-42"), Ok(job("slurm-42", None)));
        assert_eq!(
            parse_restart_from("slurm-42-7"),
            Ok(job("slurm-42", Some("slurm-42-7")))
        );
        for d in ["/ck/sim", "ck", "slurm-x", "slurm-4-2-1", "slurm-"] {
            assert_eq!(parse_restart_from(d), Ok(RestartFrom::Dir(d.into())));
        }
        assert!(parse_restart_from("").is_err());
    }
}
