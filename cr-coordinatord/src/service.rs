//! The gRPC Coordinator service: agents register and heartbeat, crctl
//! administers. Who may call what is decided by the client's certificate
//! (`cr_rpc::identity`): Register/Heartbeat/Launch of node N only with N's
//! own; Checkpoint/Restart/Configure with an administrator's, or with node
//! N's for one of N's users ([`crate::users`]); the rest only with an
//! administrator's. Checkpoints and restarts run in tasks of their own, so that
//! a client that goes away never cuts the protocol short.

use crate::coordinator::Coordinator;
use crate::error::Error;
use crate::migrate::Placement;
use crate::protocol::{CheckpointOpts, RestartOpts};
use cr_rpc::pb;
use cr_rpc::pb::coordinator_server::CoordinatorServer;
use std::collections::HashMap;
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

/// Register / Heartbeat of `node`: only with a certificate naming it that
/// is not an administrator's (none at all in insecure mode).
fn check_node<T>(req: &Request<T>, node: &str) -> Result<(), Status> {
    match cr_rpc::identity::of_request(req)? {
        None => Ok(()),
        Some(p) if p.names(node) && !p.is_admin() => Ok(()),
        Some(p) => {
            tracing::warn!(node, peer = %p.describe(), "registration refused: the certificate does not name the node");
            Err(Status::permission_denied(format!(
                "{} may not act as node {node}: a node's certificate must name it",
                p.describe()
            )))
        }
    }
}

/// An administrative call: only with an administrator's certificate.
fn check_admin<T>(req: &Request<T>, what: &str) -> Result<(), Status> {
    match cr_rpc::identity::of_request(req)? {
        None => Ok(()),
        Some(p) if p.is_admin() => Ok(()),
        Some(p) => {
            tracing::warn!(call = what, peer = %p.describe(), "administrative call refused");
            Err(Status::permission_denied(format!(
                "{what} needs an administrator's certificate (crctl pki issue --admin); this is {}",
                p.describe()
            )))
        }
    }
}

/// A job call made by an administrator (`from_node` empty: None) or by
/// the agent of node `from_node` for one of its users (its certificate
/// must name that node; see [`crate::users`]).
fn asker<T>(req: &Request<T>, from_node: &str, what: &str) -> Result<Option<String>, Status> {
    if from_node.is_empty() {
        check_admin(req, what)?;
        Ok(None)
    } else {
        check_node(req, from_node)?;
        Ok(Some(from_node.to_string()))
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
        check_node(&req, &req.get_ref().node)?;
        Ok(Response::new(self.0.register(req.into_inner()).await?))
    }

    async fn heartbeat(
        &self,
        req: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatReply>, Status> {
        check_node(&req, &req.get_ref().node)?;
        Ok(Response::new(self.0.heartbeat(req.into_inner()).await?))
    }

    async fn nodes(&self, req: Request<pb::Empty>) -> Result<Response<pb::NodesReply>, Status> {
        check_admin(&req, "Nodes")?;
        Ok(Response::new(self.0.nodes()))
    }

    async fn jobs(&self, req: Request<pb::Empty>) -> Result<Response<pb::JobsReply>, Status> {
        check_admin(&req, "Jobs")?;
        Ok(Response::new(self.0.jobs()))
    }

    async fn checkpoint(
        &self,
        req: Request<pb::CheckpointRequest>,
    ) -> Result<Response<pb::CheckpointInfo>, Status> {
        let user = asker(&req, &req.get_ref().from_node, "Checkpoint")?;
        let req = req.into_inner();
        job_name(&req.job)?;
        if let Some(node) = &user {
            self.0.check_user_job(&req.job, node, req.uid).await?;
            tracing::info!(
                job = req.job,
                node,
                uid = req.uid,
                "checkpoint asked by a user"
            );
        }
        let after = pb::After::try_from(req.after).map_err(|_| Error::Invalid {
            what: format!("unknown after value {}", req.after),
        })?;
        let c = self.0.clone();
        joined(
            tokio::spawn(async move {
                let opts = CheckpointOpts {
                    timeout: timeout(req.timeout_secs),
                    freeze: (req.freeze_timeout_ms > 0)
                        .then(|| Duration::from_millis(req.freeze_timeout_ms)),
                    pre_copy: req.pre_copy.then(HashMap::new),
                    non_blocking: req.non_blocking,
                    coop: req.coop,
                    ..Default::default()
                };
                c.checkpoint_on(&req.job, after, &opts).await
            })
            .await,
        )
    }

    async fn restart(
        &self,
        req: Request<pb::RestartRequest>,
    ) -> Result<Response<pb::RestartReply>, Status> {
        let user = asker(&req, &req.get_ref().from_node, "Restart")?;
        let mut req = req.into_inner();
        job_name(&req.job)?;
        let ck = Some(req.checkpoint.clone()).filter(|s| !s.is_empty());
        let ck = match &user {
            None => ck,
            Some(node) => {
                // Pulled onto the asking node; a job that ran on several
                // nodes may be spread over others with it (a requeued
                // Slurm job's new allocation, the asking node first), as
                // far as its user reaches already with cr_rsh (Launch).
                if req.on.is_empty() {
                    req.on = vec![node.clone()];
                } else if !req.on.contains(node) {
                    return Err(Error::Invalid {
                        what: format!("a restart asked from {node} must go to {node} too"),
                    }
                    .into());
                }
                let id = self
                    .0
                    .check_user_checkpoint(&req.job, ck.as_deref(), node, req.uid)?;
                tracing::info!(
                    job = req.job,
                    node,
                    uid = req.uid,
                    checkpoint = id,
                    "restart asked by a user"
                );
                Some(id)
            }
        };
        let c = self.0.clone();
        joined(
            tokio::spawn(async move {
                let opts = RestartOpts {
                    timeout: timeout(req.timeout_secs),
                    allow_changed_files: req.allow_changed_files,
                    line: req.line,
                    ..Default::default()
                };
                // No --on: where it was, but off nodes down or drained.
                let placement = if req.on.is_empty() {
                    Placement::Auto
                } else {
                    Placement::Nodes(req.on)
                };
                c.restart_placed(&req.job, ck.as_deref(), &placement, &opts)
                    .await
            })
            .await,
        )
    }

    async fn checkpoints(
        &self,
        req: Request<pb::CheckpointsRequest>,
    ) -> Result<Response<pb::CheckpointsReply>, Status> {
        check_admin(&req, "Checkpoints")?;
        let req = req.into_inner();
        Ok(Response::new(self.0.checkpoints(&req.job, req.all)?))
    }

    async fn recovery_line(
        &self,
        req: Request<pb::RecoveryLineRequest>,
    ) -> Result<Response<pb::RecoveryLineReply>, Status> {
        check_admin(&req, "RecoveryLine")?;
        Ok(Response::new(self.0.recovery_line(&req.into_inner().job)?))
    }

    async fn status(&self, req: Request<pb::Empty>) -> Result<Response<pb::StatusReply>, Status> {
        check_admin(&req, "Status")?;
        Ok(Response::new(self.0.status()))
    }

    async fn migrate(
        &self,
        req: Request<pb::MigrateRequest>,
    ) -> Result<Response<pb::MigrateReply>, Status> {
        check_admin(&req, "Migrate")?;
        let req = req.into_inner();
        job_name(&req.job)?;
        // No --to: the coordinator chooses (Coordinator::migrate).
        let c = self.0.clone();
        joined(
            tokio::spawn(async move {
                c.migrate(
                    &req.job,
                    &req.member,
                    &req.to,
                    timeout(req.timeout_secs),
                    req.pre_copy,
                    req.lazy,
                )
                .await
            })
            .await,
        )
    }

    async fn drain(
        &self,
        req: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::DrainReply>, Status> {
        // An administrator, or a node's agent draining its own node.
        let from = asker(&req, &req.get_ref().from_node, "Drain")?;
        let req = req.into_inner();
        let reason = match &from {
            Some(node) if *node != req.node => {
                return Err(Status::permission_denied(format!(
                    "node {node} may drain only itself, not {}",
                    req.node
                )))
            }
            Some(node) => {
                let why = if req.reason.is_empty() {
                    "no reason given"
                } else {
                    req.reason.as_str()
                };
                tracing::info!(node, reason = why, "drain asked by the node's own agent");
                format!("asked by {node}'s agent: {why}")
            }
            None => String::new(),
        };
        let c = self.0.clone();
        joined(
            tokio::spawn(async move {
                c.drain(&req.node, timeout(req.deadline_secs), &reason)
                    .await
            })
            .await,
        )
    }

    type WatchStream = tokio_stream::wrappers::ReceiverStream<Result<pb::Event, Status>>;

    async fn watch(
        &self,
        req: Request<pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        check_admin(&req, "Watch")?;
        Ok(Response::new(crate::events::watch(
            self.0.clone(),
            req.into_inner().job,
        )))
    }

    async fn undrain(
        &self,
        req: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::NodeInfo>, Status> {
        check_admin(&req, "Undrain")?;
        Ok(Response::new(self.0.undrain(&req.into_inner().node)?))
    }

    async fn configure(
        &self,
        req: Request<pb::ConfigureRequest>,
    ) -> Result<Response<pb::JobInfo>, Status> {
        let user = asker(&req, &req.get_ref().from_node, "Configure")?;
        let req = req.into_inner();
        job_name(&req.job)?;
        if let Some(node) = &user {
            self.0.check_user_job(&req.job, node, req.uid).await?;
        }
        Ok(Response::new(self.0.configure(&req)?))
    }

    async fn launch(
        &self,
        req: Request<pb::LaunchRequest>,
    ) -> Result<Response<pb::LaunchReply>, Status> {
        let from = req.get_ref().from_node.clone();
        check_node(&req, &from)?;
        let req = req.into_inner();
        job_name(&req.job)?;
        let c = self.0.clone();
        joined(tokio::spawn(async move { c.launch(&from, req).await }).await)
    }
}
