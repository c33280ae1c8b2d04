//! The `Local` service on the agent's Unix socket: `cr_run --job`,
//! `cr_checkpoint` and `cr_restart` of this node, on behalf of the user
//! they run as (see [`super::authz`]).

use super::authz::Caller;
use super::{members, Shared};
use cr_engine::capture;
use cr_proto::coop::Done;
use cr_rpc::pb;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use tonic::{Request, Response, Status};

pub struct LocalService {
    pub shared: Arc<Shared>,
}

fn caller<T>(req: &Request<T>) -> Result<Caller, Status> {
    req.extensions()
        .get::<tonic::transport::server::UdsConnectInfo>()
        .and_then(|i| i.peer_cred)
        .map(|c| Caller {
            uid: c.uid(),
            gid: c.gid(),
            pid: c.pid().unwrap_or(0),
        })
        .ok_or_else(|| Status::permission_denied("the caller's credentials are unknown"))
}

fn denied(e: String) -> Status {
    if e.starts_with("permission denied") {
        Status::permission_denied(e)
    } else {
        Status::failed_precondition(e)
    }
}

fn absolute(p: &str, what: &str) -> Result<PathBuf, Status> {
    let p = PathBuf::from(p);
    if p.is_absolute() {
        Ok(p)
    } else {
        Err(Status::invalid_argument(format!(
            "{what} {} is not an absolute path",
            p.display()
        )))
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(e.to_string()))?
        .map_err(Status::failed_precondition)
}

#[tonic::async_trait]
impl pb::local_server::Local for LocalService {
    async fn checkpoint(
        &self,
        req: Request<pb::LocalCheckpointRequest>,
    ) -> Result<Response<pb::LocalCheckpointReply>, Status> {
        let who = caller(&req)?;
        let s = self.local_checkpoint(who, req.into_inner())?.await?;
        Ok(Response::new(cr_rpc::opts::summary_reply(&s)))
    }

    async fn request_checkpoint(
        &self,
        req: Request<pb::SelfCheckpointRequest>,
    ) -> Result<Response<pb::Empty>, Status> {
        let who = caller(&req)?;
        self.request_self(who, req.into_inner())?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn restore(
        &self,
        req: Request<pb::LocalRestoreRequest>,
    ) -> Result<Response<pb::LocalRestoreReply>, Status> {
        let who = caller(&req)?;
        let r = req.into_inner();
        let dir = absolute(&r.dir, "image directory")?;
        who.check_image(&dir).map_err(denied)?;
        if !who.is_root() {
            let ck = cr_image::ImageDir::open(&dir)
                .and_then(|d| d.read_checkpoint())
                .map_err(|e| Status::failed_precondition(cr_sys::error::one_line(&e)))?;
            cr_engine::kinds::identity::check_owner(&ck.processes, who.uid, who.gid)
                .and_then(|()| cr_engine::kinds::sysv::check_owner(&ck, who.uid, who.gid))
                .map_err(|e| Status::permission_denied(cr_sys::error::one_line(&e)))?;
        }
        let mut opts = cr_rpc::opts::restore_options(&r).map_err(Status::invalid_argument)?;
        opts.workers = opts.workers.or(Some(self.shared.workers));
        tracing::info!(dir = %dir.display(), uid = who.uid, "local restore");
        let pid = blocking(move || {
            cr_engine::restore(&dir, &opts).map_err(|e| cr_sys::error::one_line(&e))
        })
        .await?;
        self.shared.reaper.watch(pid);
        Ok(Response::new(pb::LocalRestoreReply { pid }))
    }

    async fn wait(&self, req: Request<pb::WaitRequest>) -> Result<Response<pb::WaitReply>, Status> {
        let who = caller(&req)?;
        let pid = req.into_inner().pid;
        if !self.shared.reaper.is_watched(pid) {
            return Err(Status::not_found(format!(
                "process {pid} was not restored by this agent"
            )));
        }
        if !who.is_root() {
            let (uid, _) = members::describe(pid);
            if members::start_time(pid).is_some() && uid != who.uid {
                return Err(denied(format!(
                    "permission denied: process {pid} belongs to uid {uid} (you are uid {})",
                    who.uid
                )));
            }
        }
        let status = self
            .shared
            .reaper
            .wait(pid)
            .await
            .map_err(Status::not_found)?;
        Ok(Response::new(pb::WaitReply { status }))
    }

    async fn join(&self, req: Request<pb::Member>) -> Result<Response<pb::Empty>, Status> {
        let who = caller(&req)?;
        let m = req.into_inner();
        if m.job.is_empty() || m.job.contains(['/', ' ']) {
            return Err(Status::invalid_argument(format!(
                "bad job name {:?}",
                m.job
            )));
        }
        who.check_process(m.pid).map_err(denied)?;
        for f in &m.save_file {
            who.check_owned(&absolute(f, "file to save")?, "file to save")
                .map_err(denied)?;
        }
        if self
            .shared
            .drained
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return Err(Status::failed_precondition(format!(
                "node {} is drained (crctl undrain {0} lifts it): no new job member here",
                self.shared.config.node
            )));
        }
        let start_time = members::start_time(m.pid)
            .ok_or_else(|| Status::not_found(format!("no process {}", m.pid)))?;
        let (uid, command) = members::describe(m.pid);
        self.shared.members.add(pb::Member {
            job: m.job,
            pid: m.pid,
            uid,
            command,
            start_time,
            save_file: m.save_file,
            rss: 0,
        });
        self.shared.wake.notify_one();
        Ok(Response::new(pb::Empty {}))
    }

    async fn launch(
        &self,
        req: Request<pb::LaunchRequest>,
    ) -> Result<Response<pb::LaunchReply>, Status> {
        let who = caller(&req)?;
        let mut r = req.into_inner();
        // cr_run joins its job just after starting the command, which may
        // already be asking (mpiexec starting its remote proxies): wait a
        // moment for the join.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        r.job = loop {
            match super::launch::job_of(&self.shared, who.pid) {
                Ok(job) => break job,
                Err(e) if std::time::Instant::now() > deadline => {
                    return Err(Status::failed_precondition(e))
                }
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
            }
        };
        r.uid = who.uid;
        r.gid = who.gid;
        tracing::info!(
            job = r.job,
            host = r.host,
            pid = who.pid,
            uid = who.uid,
            "launch asked"
        );
        Ok(Response::new(
            super::launch::forward(&self.shared, r).await?,
        ))
    }

    async fn checkpoint_job(
        &self,
        req: Request<pb::CheckpointRequest>,
    ) -> Result<Response<pb::CheckpointInfo>, Status> {
        let (mut client, q) = self.for_user(req, "a job's checkpoint")?;
        Ok(Response::new(super::link::relay(
            client.checkpoint(q).await,
        )?))
    }

    async fn restart_job(
        &self,
        req: Request<pb::RestartRequest>,
    ) -> Result<Response<pb::RestartReply>, Status> {
        let (mut client, q) = self.for_user(req, "a job's restart here")?;
        Ok(Response::new(super::link::relay(client.restart(q).await)?))
    }

    async fn configure_job(
        &self,
        req: Request<pb::ConfigureRequest>,
    ) -> Result<Response<pb::JobInfo>, Status> {
        let (mut client, q) = self.for_user(req, "a job's settings")?;
        Ok(Response::new(super::link::relay(
            client.configure(q).await,
        )?))
    }

    async fn drain_node(
        &self,
        req: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::DrainReply>, Status> {
        let who = caller(&req)?;
        if who.uid != 0 {
            return Err(Status::permission_denied(format!(
                "permission denied: only root may drain this node (uid {} asked)",
                who.uid
            )));
        }
        let r = req.into_inner();
        let reason = if r.reason.is_empty() {
            format!("crctl drain --self (pid {})", who.pid)
        } else {
            format!("{} (crctl drain --self, pid {})", r.reason, who.pid)
        };
        Ok(Response::new(
            super::health::drain_self(&self.shared, &reason, r.deadline_secs).await?,
        ))
    }
}

impl LocalService {
    /// A program asks for a checkpoint of itself (`who`'s tree) or of its
    /// whole job (`Local.RequestCheckpoint`, or libcr's `SELF` on the
    /// agent's libcr socket): accepted now, carried out on its own; its
    /// end goes to the program's libcr socket (DONE).
    pub fn request_self(&self, who: Caller, r: pb::SelfCheckpointRequest) -> Result<(), Status> {
        let pid = who.pid;
        if pid <= 0 {
            return Err(Status::failed_precondition("the caller's pid is unknown"));
        }
        let request = r.request;
        let work: std::pin::Pin<Box<dyn Future<Output = Result<String, Status>> + Send>> = if r.job
        {
            let job =
                super::launch::job_of(&self.shared, pid).map_err(Status::failed_precondition)?;
            let mut client = super::link::coordinator(&self.shared, "a job's checkpoint")?;
            let mut q = Request::new(pb::CheckpointRequest {
                job: job.clone(),
                after: r.after,
                from_node: self.shared.config.node.clone(),
                uid: who.uid,
                ..Default::default()
            });
            q.set_timeout(job_call_timeout(0));
            tracing::info!(
                job,
                pid,
                uid = who.uid,
                "a member asked for a checkpoint of its job"
            );
            Box::pin(async move {
                let info = super::link::relay(client.checkpoint(q).await)?;
                Ok(format!("checkpoint {} of job {}", info.id, info.job))
            })
        } else {
            let root = capture::job_root(pid);
            let dir = if r.dir.is_empty() {
                default_image_dir(pid, root)?
            } else {
                r.dir
            };
            let lr = pb::LocalCheckpointRequest {
                pid,
                dir: dir.clone(),
                after: r.after,
                ..Default::default()
            };
            let s = self.local_checkpoint(who, lr)?;
            Box::pin(async move {
                let s = s.await?;
                Ok(format!(
                    "checkpoint of {} processes into {dir}",
                    s.processes
                ))
            })
        };
        tokio::spawn(async move {
            let done = match work.await {
                Ok(message) => Done {
                    request,
                    ok: true,
                    message,
                },
                Err(s) => {
                    tracing::warn!(
                        pid,
                        request,
                        error = s.message(),
                        "requested checkpoint failed"
                    );
                    Done {
                        request,
                        ok: false,
                        message: s.message().to_string(),
                    }
                }
            };
            let _ =
                tokio::task::spawn_blocking(move || cr_engine::coop::tell_done(pid, &done)).await;
        });
        Ok(())
    }

    /// A checkpoint of the tree of `r.pid` for `who`: checked now, carried
    /// out by the returned future.
    fn local_checkpoint(
        &self,
        who: Caller,
        r: pb::LocalCheckpointRequest,
    ) -> Result<impl Future<Output = Result<cr_engine::Summary, Status>> + Send + 'static, Status>
    {
        let dir = absolute(&r.dir, "image directory")?;
        let root = capture::job_root(r.pid);
        who.check_process(root).map_err(denied)?;
        who.check_new_image(&dir).map_err(denied)?;
        let parent = if r.parent.is_empty() {
            None
        } else {
            let p = absolute(&r.parent, "parent image")?;
            who.check_image(&p).map_err(denied)?;
            Some(p)
        };
        let mut opts = cr_rpc::opts::checkpoint_options(&r).map_err(Status::invalid_argument)?;
        opts.dir = Some(dir.clone());
        opts.parent = parent;
        opts.workers = opts.workers.or(Some(self.shared.workers));
        tracing::info!(pid = root, dir = %dir.display(), uid = who.uid, "local checkpoint");
        // One owner of a traced process: the reaper lets it alone meanwhile.
        let loan = self.shared.reaper.lend(&[root]);
        Ok(blocking(move || {
            let _loan = loan;
            let s = capture::checkpoint(root, &opts).map_err(|e| cr_sys::error::one_line(&e))?;
            who.give(&dir);
            Ok(s)
        }))
    }
}

/// Where a checkpoint a process asked for goes by default: its job's
/// `cr_run --dir`, else `ckpt.ROOT` in the process's working directory.
fn default_image_dir(pid: i32, root: i32) -> Result<String, Status> {
    if let Some(d) = capture::job_dir(root) {
        return Ok(d.display().to_string());
    }
    let cwd = std::fs::read_link(format!("/proc/{pid}/cwd")).map_err(|e| {
        Status::failed_precondition(format!(
            "cannot find the working directory of process {pid}: {e}"
        ))
    })?;
    Ok(cwd.join(format!("ckpt.{root}")).display().to_string())
}

/// A job request the agent relays to the coordinator for a local user
/// (see `cr_coordinatord::users`): it names this node and the user.
trait ForUser {
    fn job(&self) -> &str;
    fn stamp(&mut self, node: String, uid: u32);
    /// The request's own deadline (0: the coordinator's default).
    fn timeout_secs(&self) -> u32;
}

/// The requests have the same fields for it (`job`, `from_node`, `uid`).
macro_rules! for_user {
    ($($t:ty => |$r:pat_param| $timeout:expr),* $(,)?) => {$(
        impl ForUser for $t {
            fn job(&self) -> &str {
                &self.job
            }
            fn stamp(&mut self, node: String, uid: u32) {
                (self.from_node, self.uid) = (node, uid);
            }
            fn timeout_secs(&self) -> u32 {
                let $r = self;
                $timeout
            }
        }
    )*};
}

for_user!(
    pb::CheckpointRequest => |r| r.timeout_secs,
    pb::RestartRequest => |r| r.timeout_secs,
    pb::ConfigureRequest => |_| 0,
);

impl LocalService {
    /// `req` stamped with this node and its caller's uid, with its
    /// deadline, and a client of the coordinator to send it to.
    fn for_user<T: ForUser>(
        &self,
        req: Request<T>,
        what: &str,
    ) -> Result<
        (
            pb::coordinator_client::CoordinatorClient<tonic::transport::Channel>,
            Request<T>,
        ),
        Status,
    > {
        let who = caller(&req)?;
        let mut r = req.into_inner();
        r.stamp(self.shared.config.node.clone(), who.uid);
        tracing::info!(job = r.job(), uid = who.uid, "{what} asked");
        let client = super::link::coordinator(&self.shared, what)?;
        let t = job_call_timeout(r.timeout_secs());
        let mut q = Request::new(r);
        q.set_timeout(t);
        Ok((client, q))
    }
}

/// Deadline of a job call relayed to the coordinator: its own deadline
/// (0: the coordinator's default, 120 s) and a margin.
fn job_call_timeout(secs: u32) -> std::time::Duration {
    let secs = if secs == 0 { 120 } else { u64::from(secs) };
    std::time::Duration::from_secs(secs + 30)
}
