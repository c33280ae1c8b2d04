//! The `Agent` service the coordinator calls (TCP, mutual TLS): the steps
//! of the coordinated protocol (see [`super::sessions`]) and the removal of
//! images and network locks.

use super::{postcopy, sessions, transfer, Shared};
use cr_rpc::pb;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tonic::{Request, Response, Status};

pub struct AgentService {
    pub shared: Arc<Shared>,
}

/// Only the coordinator drives an agent: a client certificate must name the
/// coordinator's TLS name (none in insecure mode).
fn from_coordinator<T>(shared: &Shared, req: &Request<T>) -> Result<(), Status> {
    let name = &shared.config.coordinator_name;
    match cr_rpc::identity::of_request(req)? {
        None => Ok(()),
        Some(p) if p.names(name) && !p.is_admin() => Ok(()),
        Some(p) => {
            tracing::warn!(peer = %p.describe(), "call refused: not the coordinator");
            Err(Status::permission_denied(format!(
                "only the coordinator ({name}) may call this agent; this is {}",
                p.describe()
            )))
        }
    }
}

/// Another agent of the cluster (a node's certificate: any name, not an
/// administrator's), or the coordinator: may read this node's images.
fn from_peer<T>(req: &Request<T>) -> Result<(), Status> {
    match cr_rpc::identity::of_request(req)? {
        None => Ok(()),
        Some(p) if !p.is_admin() => Ok(()),
        Some(p) => Err(Status::permission_denied(format!(
            "images are copied by agents only; this is {}",
            p.describe()
        ))),
    }
}

fn failed(e: String) -> Status {
    Status::aborted(e)
}

fn ok<T>(r: Result<T, String>) -> Result<Response<T>, Status> {
    r.map(Response::new).map_err(failed)
}

/// The round's calls (PREPARE, FREEZE, DUMP, ABORT, FINISH) once the
/// caller is known to be the coordinator: unary or on the Commands stream.
mod round {
    use super::{failed, sessions, Shared};
    use cr_rpc::pb;
    use pb::command::Call;
    use pb::command_reply::Reply;
    use std::sync::Arc;
    use tonic::Status;

    pub async fn prepare(
        sh: &Arc<Shared>,
        r: pb::PrepareRequest,
    ) -> Result<pb::PrepareReply, String> {
        sessions::prepare(sh.clone(), r).await
    }

    pub async fn freeze(sh: &Shared, r: pb::SessionRequest) -> Result<pb::PrepareReply, String> {
        sh.sessions.freeze(&r.session).await
    }

    pub async fn dump(sh: &Shared, r: pb::SessionRequest) -> Result<pb::DumpReply, String> {
        sh.sessions.dump(&r.session).await
    }

    pub async fn abort(sh: &Shared, r: pb::SessionRequest) -> Result<pb::Empty, String> {
        let res = sh.sessions.abort(&r.session).await;
        sessions::forget_in_doubt(&sh.config.state_dir, &r.session, true);
        res.map(|_| pb::Empty {})
    }

    pub async fn finish(sh: &Shared, r: pb::FinishRequest) -> Result<pb::FinishReply, String> {
        let after = pb::After::try_from(r.after).unwrap_or(pb::After::Continue);
        let res = sh.sessions.finish(&r.session, after, r.exit_later).await;
        // Committed: images kept in doubt by a session that ended alone stay.
        sessions::forget_in_doubt(&sh.config.state_dir, &r.session, false);
        res
    }

    /// One command of the Commands stream: its unary call's reply or status.
    pub async fn command(sh: Arc<Shared>, call: Call) -> Result<Reply, Status> {
        let r = match call {
            Call::Prepare(r) => prepare(&sh, r).await.map(Reply::Prepare),
            Call::Freeze(r) => freeze(&sh, r).await.map(Reply::Freeze),
            Call::Dump(r) => dump(&sh, r).await.map(Reply::Dump),
            Call::Abort(r) => abort(&sh, r).await.map(Reply::Abort),
            Call::Finish(r) => finish(&sh, r).await.map(Reply::Finish),
        };
        r.map_err(failed)
    }
}

impl AgentService {
    /// `dir` lies under the agent's image root (the only images it removes).
    /// The image root, as the kernel names it.
    fn own_root(&self) -> PathBuf {
        self.shared
            .config
            .images
            .canonicalize()
            .unwrap_or_else(|_| self.shared.config.images.clone())
    }

    fn own_image(&self, dir: &str) -> Result<PathBuf, Status> {
        let root = self.own_root();
        let d = Path::new(dir);
        let d = d.canonicalize().unwrap_or_else(|_| d.to_path_buf());
        if !d.starts_with(&root) || d == root {
            return Err(Status::permission_denied(format!(
                "{dir} is not an image under {}",
                root.display()
            )));
        }
        Ok(d)
    }
}

/// Remove the network lock an image kept (in this node's namespace).
fn unlock_image(dir: &Path) {
    let Ok(ck) = cr_image::ImageDir::open(dir).and_then(|d| d.read_checkpoint()) else {
        return;
    };
    let Some(lock) = ck.netlock else {
        return;
    };
    match cr_sys::netlock::unlock(None, &lock) {
        Ok(true) => tracing::info!(lock, "network lock of a moved image removed"),
        Ok(false) => {}
        Err(e) => {
            tracing::warn!(lock, error = %cr_sys::error::one_line(&e), "cannot remove a network lock")
        }
    }
}

#[tonic::async_trait]
impl pb::agent_server::Agent for AgentService {
    type ReadImageFileStream =
        tokio_stream::wrappers::ReceiverStream<Result<pb::FileChunk, Status>>;
    type ServePagesStream = tokio_stream::wrappers::ReceiverStream<Result<pb::PageBlock, Status>>;

    async fn serve_pages(
        &self,
        req: Request<tonic::Streaming<pb::PageWant>>,
    ) -> Result<Response<Self::ServePagesStream>, Status> {
        from_peer(&req)?;
        let rx = postcopy::serve(self.shared.clone(), req.into_inner()).await?;
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(
            rx,
        )))
    }

    async fn pre_dump(
        &self,
        req: Request<pb::PreDumpRequest>,
    ) -> Result<Response<pb::PreDumpReply>, Status> {
        from_coordinator(&self.shared, &req)?;
        let r = req.into_inner();
        let sh = &self.shared;
        let dir = transfer::under(&sh.config.images, &r.subdir)
            .map_err(Status::invalid_argument)?
            .join(format!("{}-{}", sh.config.node, r.pid));
        let parent = (!r.parent.is_empty())
            .then(|| self.own_image(&r.parent))
            .transpose()?;
        let opts = cr_engine::options::CheckpointOptions {
            dir: Some(dir.clone()),
            parent,
            pre_dump: true,
            workers: Some(sh.workers),
            ..Default::default()
        };
        // One owner of a traced process: the reaper lets it alone meanwhile.
        let loan = sh.reaper.lend(&[r.pid]);
        let pid = r.pid;
        let res = tokio::task::spawn_blocking(move || {
            let _loan = loan;
            if let Some(p) = dir.parent() {
                std::fs::create_dir_all(p).map_err(|e| format!("{}: {e}", p.display()))?;
            }
            let s = cr_engine::capture::checkpoint(pid, &opts)
                .map_err(|e| format!("process {pid}: {}", cr_sys::error::one_line(&e)))?;
            Ok(pb::PreDumpReply {
                dir: dir.display().to_string(),
                page_bytes: s.page_bytes,
                store_bytes: s.store_bytes,
                frozen_us: s.frozen.as_micros() as u64,
            })
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?;
        ok(res)
    }

    async fn fetch(
        &self,
        req: Request<pb::FetchRequest>,
    ) -> Result<Response<pb::FetchReply>, Status> {
        from_coordinator(&self.shared, &req)?;
        ok(transfer::fetch(self.shared.clone(), req.into_inner()).await)
    }

    async fn image_manifest(
        &self,
        req: Request<pb::ManifestRequest>,
    ) -> Result<Response<pb::Manifest>, Status> {
        from_peer(&req)?;
        let req = req.into_inner();
        let dirs = req
            .dirs
            .iter()
            .map(|d| self.own_image(d).map(|p| p.display().to_string()))
            .collect::<Result<Vec<_>, _>>()?;
        let sh = self.shared.clone();
        let lazy = req.lazy;
        let r = tokio::task::spawn_blocking(move || transfer::manifest(&sh, &dirs, lazy))
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        r.map(Response::new).map_err(Status::not_found)
    }

    async fn read_image_file(
        &self,
        req: Request<pb::ReadFileRequest>,
    ) -> Result<Response<Self::ReadImageFileStream>, Status> {
        from_peer(&req)?;
        let r = req.into_inner();
        let rx = transfer::read_file(&self.shared, &r.path, r.offset)?;
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(
            rx,
        )))
    }

    async fn prepare(
        &self,
        req: Request<pb::PrepareRequest>,
    ) -> Result<Response<pb::PrepareReply>, Status> {
        from_coordinator(&self.shared, &req)?;
        ok(round::prepare(&self.shared, req.into_inner()).await)
    }

    async fn freeze(
        &self,
        req: Request<pb::SessionRequest>,
    ) -> Result<Response<pb::PrepareReply>, Status> {
        from_coordinator(&self.shared, &req)?;
        ok(round::freeze(&self.shared, req.into_inner()).await)
    }

    async fn dump(
        &self,
        req: Request<pb::SessionRequest>,
    ) -> Result<Response<pb::DumpReply>, Status> {
        from_coordinator(&self.shared, &req)?;
        ok(round::dump(&self.shared, req.into_inner()).await)
    }

    async fn abort(&self, req: Request<pb::SessionRequest>) -> Result<Response<pb::Empty>, Status> {
        from_coordinator(&self.shared, &req)?;
        ok(round::abort(&self.shared, req.into_inner()).await)
    }

    async fn finish(
        &self,
        req: Request<pb::FinishRequest>,
    ) -> Result<Response<pb::FinishReply>, Status> {
        from_coordinator(&self.shared, &req)?;
        ok(round::finish(&self.shared, req.into_inner()).await)
    }

    type CommandsStream = cr_rpc::commands::ReplyStream;

    /// The same five calls on one stream: the caller is checked once, each
    /// command handled as its unary call.
    async fn commands(
        &self,
        req: Request<tonic::Streaming<pb::Command>>,
    ) -> Result<Response<Self::CommandsStream>, Status> {
        from_coordinator(&self.shared, &req)?;
        let sh = self.shared.clone();
        Ok(Response::new(cr_rpc::commands::serve(
            req.into_inner(),
            move |call| round::command(sh.clone(), call),
        )))
    }

    async fn restore(
        &self,
        req: Request<pb::RestoreRequest>,
    ) -> Result<Response<pb::RestoreReply>, Status> {
        from_coordinator(&self.shared, &req)?;
        ok(sessions::restore(self.shared.clone(), req.into_inner()).await)
    }

    async fn release(
        &self,
        req: Request<pb::SessionRequest>,
    ) -> Result<Response<pb::ReleaseReply>, Status> {
        from_coordinator(&self.shared, &req)?;
        let r = self
            .shared
            .sessions
            .release(&req.into_inner().session)
            .await;
        self.shared.wake.notify_one();
        ok(r)
    }

    async fn job_back(
        &self,
        req: Request<pb::SessionRequest>,
    ) -> Result<Response<pb::Empty>, Status> {
        from_coordinator(&self.shared, &req)?;
        let session = req.into_inner().session;
        let shared = self.shared.clone();
        // Connects to every restored libcr program: off the runtime.
        let _ = tokio::task::spawn_blocking(move || shared.job_back.tell(&session)).await;
        Ok(Response::new(pb::Empty {}))
    }

    async fn remove(&self, req: Request<pb::RemoveRequest>) -> Result<Response<pb::Empty>, Status> {
        from_coordinator(&self.shared, &req)?;
        let dirs = req
            .into_inner()
            .dirs
            .iter()
            .map(|d| self.own_image(d))
            .collect::<Result<Vec<_>, _>>()?;
        let root = self.own_root();
        let r = tokio::task::spawn_blocking(move || {
            for d in dirs {
                if !d.exists() {
                    continue;
                }
                unlock_image(&d);
                // Images made incremental on this one get its pages first;
                // the pre-dumps it was made on go with it once nothing
                // else needs them.
                let removed = cr_image::chain::remove_unused(&d, true, true, &root)
                    .map_err(|e| format!("{}: {}", d.display(), cr_sys::error::one_line(&e)))?;
                for r in &removed {
                    // The checkpoint's (or pre-copy round's) directories go
                    // with their last image.
                    if let Some(p) = r.parent() {
                        transfer::prune(&root, p);
                    }
                    tracing::info!(dir = %r.display(), "image removed");
                }
            }
            Ok(pb::Empty {})
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?;
        ok(r)
    }

    async fn unlock(&self, req: Request<pb::RemoveRequest>) -> Result<Response<pb::Empty>, Status> {
        from_coordinator(&self.shared, &req)?;
        let dirs = req.into_inner().dirs;
        let shared = self.shared.clone();
        tokio::task::spawn_blocking(move || {
            // The locks of moved images go once their killed members are
            // gone (a migration's FINISH did not wait for their exit).
            shared.sessions.wait_exits();
            for d in dirs {
                unlock_image(Path::new(&d));
            }
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn launch(
        &self,
        req: Request<pb::LaunchRequest>,
    ) -> Result<Response<pb::LaunchReply>, Status> {
        from_coordinator(&self.shared, &req)?;
        let r = req.into_inner();
        let pid = super::launch::start(&self.shared, &r).map_err(Status::failed_precondition)?;
        Ok(Response::new(pb::LaunchReply {
            node: self.shared.config.node.clone(),
            pid,
        }))
    }
}
