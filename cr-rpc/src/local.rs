//! A blocking client of the node's agent (its Unix socket), for the
//! command-line tools: they go through the agent when it runs and work on
//! their own when it does not.

use crate::pb;
use crate::pb::local_client::LocalClient;
use crate::RpcError;
use std::path::{Path, PathBuf};
use tonic::transport::Channel;

/// How long [`Agent::checkpoint_job`] waits for another operation of the
/// job to end.
pub const BUSY_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

pub struct Agent {
    rt: tokio::runtime::Runtime,
    client: LocalClient<Channel>,
    pub socket: PathBuf,
}

fn runtime() -> Result<tokio::runtime::Runtime, RpcError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| RpcError::Connect {
            addr: "agent".into(),
            what: e.to_string(),
        })
}

impl Agent {
    /// The agent on `socket`.
    pub fn connect(socket: &Path) -> Result<Agent, RpcError> {
        let rt = runtime()?;
        let ch = rt.block_on(crate::channel::local(socket))?;
        Ok(Agent {
            rt,
            client: LocalClient::new(ch),
            socket: socket.to_path_buf(),
        })
    }

    /// The node's agent (`CR_AGENT_SOCKET` or the default socket) if one
    /// answers; None when no agent runs.
    pub fn if_running() -> Option<Agent> {
        let socket = crate::channel::agent_socket();
        if !socket.exists() {
            return None;
        }
        match Agent::connect(&socket) {
            Ok(a) => Some(a),
            Err(e) => {
                tracing::debug!(socket = %socket.display(), error = %e, "no agent: working standalone");
                None
            }
        }
    }

    fn call<T, F>(&mut self, f: impl FnOnce(LocalClient<Channel>) -> F) -> Result<T, String>
    where
        F: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        self.call_status(f).map_err(|s| crate::status_line(&s))
    }

    /// [`Agent::call`] keeping the status (its code matters to the caller).
    fn call_status<T, F>(
        &mut self,
        f: impl FnOnce(LocalClient<Channel>) -> F,
    ) -> Result<T, tonic::Status>
    where
        F: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let client = self.client.clone();
        self.rt.block_on(f(client)).map(|r| r.into_inner())
    }

    pub fn checkpoint(
        &mut self,
        req: pb::LocalCheckpointRequest,
    ) -> Result<pb::LocalCheckpointReply, String> {
        self.call(|mut c| async move { c.checkpoint(req).await })
    }

    pub fn restore(&mut self, req: pb::LocalRestoreRequest) -> Result<i32, String> {
        self.call(|mut c| async move { c.restore(req).await })
            .map(|r| r.pid)
    }

    /// Exit code (or 128 + signal) of a process the agent restored.
    pub fn wait(&mut self, pid: i32) -> Result<i32, String> {
        self.call(|mut c| async move { c.wait(pb::WaitRequest { pid }).await })
            .map(|r| r.status)
    }

    /// Make `pid` a member of `job`; the content of the files `save_file`
    /// goes into each of its images.
    pub fn join(&mut self, job: &str, pid: i32, save_file: &[String]) -> Result<(), String> {
        let m = pb::Member {
            job: job.to_string(),
            pid,
            save_file: save_file.to_vec(),
            ..Default::default()
        };
        self.call(|mut c| async move { c.join(m).await })
            .map(|_| ())
    }

    /// Start `req.command` as a member of the caller's job on `req.host`
    /// (cr_rsh); the node it runs on.
    pub fn launch(&mut self, req: pb::LaunchRequest) -> Result<pb::LaunchReply, String> {
        self.call(|mut c| async move { c.launch(req).await })
    }

    /// Checkpoint cluster job `req.job` through the coordinator, as the
    /// caller's user. Another operation of the job in progress (a periodic
    /// checkpoint) is waited for, up to [`BUSY_WAIT`].
    pub fn checkpoint_job(
        &mut self,
        req: pb::CheckpointRequest,
    ) -> Result<pb::CheckpointInfo, String> {
        let deadline = std::time::Instant::now() + BUSY_WAIT;
        loop {
            let r = req.clone();
            match self.call_status(|mut c| async move { c.checkpoint_job(r).await }) {
                Err(s)
                    if s.code() == tonic::Code::ResourceExhausted
                        && std::time::Instant::now() < deadline =>
                {
                    tracing::debug!(job = req.job, "{}; waiting", s.message());
                    std::thread::sleep(std::time::Duration::from_millis(100));
                }
                r => return r.map_err(|s| crate::status_line(&s)),
            }
        }
    }

    /// Restart cluster job `req.job` on this node through the coordinator,
    /// as the caller's user; None when the job has no checkpoint to
    /// restart from (or the coordinator knows no such job).
    pub fn restart_job(
        &mut self,
        req: pb::RestartRequest,
    ) -> Result<Option<pb::RestartReply>, String> {
        match self.call_status(|mut c| async move { c.restart_job(req).await }) {
            Ok(r) => Ok(Some(r)),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(None),
            Err(s) => Err(crate::status_line(&s)),
        }
    }

    /// [`Agent::restart_job`] of a checkpoint that must exist (`req.checkpoint`,
    /// or the job's latest committed one): none is an error naming the job
    /// or the checkpoint.
    pub fn restart_job_required(
        &mut self,
        req: pb::RestartRequest,
    ) -> Result<pb::RestartReply, String> {
        self.call(|mut c| async move { c.restart_job(req).await })
    }

    /// Drain this node (root only): the coordinator moves every member off
    /// it; answered once the drain is over.
    pub fn drain_node(&mut self, req: pb::DrainRequest) -> Result<pb::DrainReply, String> {
        self.call(|mut c| async move { c.drain_node(req).await })
    }

    /// Set cluster job `req.job`'s settings (periodic checkpoints) through
    /// the coordinator, as the caller's user.
    pub fn configure_job(&mut self, req: pb::ConfigureRequest) -> Result<pb::JobInfo, String> {
        self.call(|mut c| async move { c.configure_job(req).await })
    }
}
