//! The gRPC Coordinator service: agents register and heartbeat, crctl
//! administers. Checkpoints and restarts run in tasks of their own, so that
//! a client that goes away never cuts the protocol short.

use crate::coordinator::Coordinator;
use crate::error::Error;
use cr_rpc::pb;
use cr_rpc::pb::coordinator_server::CoordinatorServer;
use std::sync::Arc;
use std::time::Duration;
use tonic::{Request, Response, Status};

/// The service, around a shared [`Coordinator`].
#[derive(Clone)]
pub struct Service(pub Arc<Coordinator>);

impl Service {
    pub fn server(coord: Arc<Coordinator>) -> CoordinatorServer<Service> {
        CoordinatorServer::new(Service(coord))
    }
}

fn timeout(secs: u32) -> Option<Duration> {
    (secs > 0).then(|| Duration::from_secs(u64::from(secs)))
}

fn joined<T>(r: Result<Result<T, Error>, tokio::task::JoinError>) -> Result<Response<T>, Status> {
    match r {
        Ok(r) => r.map(Response::new).map_err(Status::from),
        Err(e) => Err(Status::internal(format!("the operation failed: {e}"))),
    }
}

fn job_name(job: &str) -> Result<(), Status> {
    if job.is_empty() {
        return Err(Error::Invalid {
            what: "no job named".into(),
        }
        .into());
    }
    Ok(())
}

#[tonic::async_trait]
impl pb::coordinator_server::Coordinator for Service {
    async fn register(
        &self,
        req: Request<pb::RegisterRequest>,
    ) -> Result<Response<pb::RegisterReply>, Status> {
        Ok(Response::new(self.0.register(req.into_inner())?))
    }

    async fn heartbeat(
        &self,
        req: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatReply>, Status> {
        Ok(Response::new(self.0.heartbeat(req.into_inner())?))
    }

    async fn nodes(&self, _: Request<pb::Empty>) -> Result<Response<pb::NodesReply>, Status> {
        Ok(Response::new(self.0.nodes()))
    }

    async fn jobs(&self, _: Request<pb::Empty>) -> Result<Response<pb::JobsReply>, Status> {
        Ok(Response::new(self.0.jobs()))
    }

    async fn checkpoint(
        &self,
        req: Request<pb::CheckpointRequest>,
    ) -> Result<Response<pb::CheckpointInfo>, Status> {
        let req = req.into_inner();
        job_name(&req.job)?;
        let after = pb::After::try_from(req.after).map_err(|_| Error::Invalid {
            what: format!("unknown after value {}", req.after),
        })?;
        let c = self.0.clone();
        joined(
            tokio::spawn(async move {
                c.checkpoint(&req.job, after, timeout(req.timeout_secs))
                    .await
            })
            .await,
        )
    }

    async fn restart(
        &self,
        req: Request<pb::RestartRequest>,
    ) -> Result<Response<pb::RestartReply>, Status> {
        let req = req.into_inner();
        job_name(&req.job)?;
        let c = self.0.clone();
        joined(
            tokio::spawn(async move {
                let ck = Some(req.checkpoint.as_str()).filter(|s| !s.is_empty());
                c.restart(&req.job, ck, &req.on, timeout(req.timeout_secs))
                    .await
            })
            .await,
        )
    }

    async fn checkpoints(
        &self,
        req: Request<pb::CheckpointsRequest>,
    ) -> Result<Response<pb::CheckpointsReply>, Status> {
        let req = req.into_inner();
        Ok(Response::new(self.0.checkpoints(&req.job, req.all)?))
    }

    async fn status(&self, _: Request<pb::Empty>) -> Result<Response<pb::StatusReply>, Status> {
        Ok(Response::new(self.0.status()))
    }

    async fn configure(
        &self,
        req: Request<pb::ConfigureRequest>,
    ) -> Result<Response<pb::JobInfo>, Status> {
        let req = req.into_inner();
        job_name(&req.job)?;
        Ok(Response::new(self.0.configure(&req)?))
    }
}
