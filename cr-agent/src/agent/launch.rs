//! Remote starts of job members (`cr_rsh`, docs/MPI.md).
//!
//! * [`job_of`]: on the caller's node, the job a process belongs to: the
//!   job of the member whose tree holds it (its nearest ancestor that is a
//!   member), so a process can only start members of its own job.
//! * [`forward`]: that node's agent sends the request to the coordinator
//!   (with its node certificate), which picks the node HOST names and
//!   calls [`start`] on that node's agent.
//! * [`start`]: `cr_run --job JOB -- COMMAND...` as the caller's uid and
//!   gid, with exactly the environment given (plus `CR_AGENT_SOCKET`, this
//!   agent's socket), stdio on /dev/null; cr_run joins the job through this
//!   agent as it always does. The agent reaps cr_run.

use super::Shared;
use cr_rpc::pb;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Deadline of a launch through the coordinator.
const LAUNCH_TIMEOUT: Duration = Duration::from_secs(30);

/// The job of the member whose tree holds `pid` (walking up the parents).
pub fn job_of(shared: &Shared, pid: i32) -> Result<String, String> {
    let mut p = pid;
    for _ in 0..4096 {
        if let Some(m) = shared.members.get(p) {
            if super::members::start_time(p) == Some(m.start_time) {
                return Ok(m.job);
            }
        }
        match cr_sys::proc::stat(p) {
            Ok(st) if st.ppid > 0 => p = st.ppid,
            _ => break,
        }
    }
    Err(format!(
        "process {pid} is in no job of this node (run it under cr_run --job)"
    ))
}

/// Send `req` to the coordinator (Coordinator.Launch) as this node.
pub async fn forward(
    shared: &Shared,
    mut req: pb::LaunchRequest,
) -> Result<pb::LaunchReply, tonic::Status> {
    let mut client = super::link::coordinator(shared, "cr_rsh")?;
    req.from_node = shared.config.node.clone();
    let mut r = tonic::Request::new(req);
    r.set_timeout(LAUNCH_TIMEOUT);
    super::link::relay(client.launch(r).await)
}

/// Start `cr_run --job JOB -- COMMAND...` here as `req` says; its PID.
pub fn start(shared: &Shared, req: &pb::LaunchRequest) -> Result<i32, String> {
    if req.command.is_empty() {
        return Err("no command to launch".into());
    }
    let cr_run = std::env::current_exe()
        .map_err(|e| format!("cannot find cr_run next to cr-agent: {e}"))?
        .with_file_name("cr_run");
    let home = req
        .env
        .iter()
        .find_map(|kv| kv.strip_prefix("HOME="))
        .unwrap_or("/");
    let cwd = [req.cwd.as_str(), home, "/"]
        .into_iter()
        .find(|d| !d.is_empty() && Path::new(d).is_dir())
        .unwrap_or("/");
    let mut cmd = Command::new(&cr_run);
    cmd.arg("--job")
        .arg(&req.job)
        .arg("--")
        .args(&req.command)
        .env_clear()
        .envs(req.env.iter().filter_map(|kv| kv.split_once('=')))
        .env(cr_rpc::AGENT_SOCKET_ENV, &shared.config.socket)
        .current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if req.uid != 0 || req.gid != 0 {
        // std drops the supplementary groups (setgroups([])) then.
        cmd.uid(req.uid).gid(req.gid);
    }
    let child = cmd
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", cr_run.display()))?;
    let pid = child.id() as i32;
    shared.reaper.watch(pid);
    tracing::info!(
        job = req.job,
        from = req.from_node,
        pid,
        uid = req.uid,
        command = ?req.command,
        "launched a member"
    );
    Ok(pid)
}
