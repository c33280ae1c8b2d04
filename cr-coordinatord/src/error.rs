//! Why a request to the coordinator failed: one readable message naming the
//! job, node or checkpoint, and the gRPC status code it maps to.

use crate::catalog::CatalogError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no job {job}")]
    UnknownJob { job: String },
    #[error("no node {node} (registered nodes: {known})")]
    UnknownNode { node: String, known: String },
    #[error("no checkpoint {id}")]
    UnknownCheckpoint { id: String },
    #[error("checkpoint {id} is not one of job {job}")]
    OtherJob { id: String, job: String },
    #[error("job {job} is busy: {what} in progress")]
    Busy { job: String, what: String },
    #[error("job {job} has no live member")]
    NoLiveMember { job: String },
    #[error("job {job}: node {node} is down ({why})")]
    NodeDown {
        job: String,
        node: String,
        why: String,
    },
    #[error(
        "job {job} still runs {count} processes; checkpoint it with --kill or stop them first"
    )]
    StillRunning { job: String, count: usize },
    #[error("job {job} has no committed checkpoint")]
    NoCheckpoint { job: String },
    #[error("checkpoint {id} is {state}: only committed checkpoints can be restarted")]
    NotCommitted { id: String, state: String },
    #[error("checkpoint {id} of job {job} aborted: {reason}")]
    Aborted {
        job: String,
        id: String,
        reason: String,
    },
    #[error("pre-copy of job {job} failed: {reason}; the job runs on")]
    PreCopyFailed { job: String, reason: String },
    #[error("restart of job {job} from {id} failed: {reason}")]
    RestartFailed {
        job: String,
        id: String,
        reason: String,
    },
    #[error("job {job}: cannot start a member on {node}: {reason}")]
    LaunchFailed {
        job: String,
        node: String,
        reason: String,
    },
    #[error("cannot drain {node}: member {member} of job {job} ({mib} MiB) fits on no other node ({best}); nothing was moved")]
    NoRoom {
        node: String,
        member: String,
        job: String,
        mib: u64,
        best: String,
    },
    #[error("node {node} is drained (crctl undrain {node} lifts it)")]
    Drained { node: String },
    #[error("migration of job {job} failed: {reason}")]
    MigrationFailed { job: String, reason: String },
    #[error("uid {uid} on {node} may not act on job {job}: it runs as uid {owner}")]
    NotOwner {
        job: String,
        uid: u32,
        node: String,
        owner: u32,
    },
    #[error("{what}")]
    Invalid { what: String },
    #[error("the coordinator is stopping")]
    Stopping,
    #[error(transparent)]
    Catalog(#[from] CatalogError),
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> tonic::Status {
        use tonic::Code;
        let code = match &e {
            Error::UnknownJob { .. }
            | Error::UnknownNode { .. }
            | Error::UnknownCheckpoint { .. }
            | Error::NoCheckpoint { .. } => Code::NotFound,
            Error::OtherJob { .. } | Error::Invalid { .. } => Code::InvalidArgument,
            // Its own code: a client may wait for the job's operation in
            // progress (cr_checkpoint --job does).
            Error::Busy { .. } => Code::ResourceExhausted,
            Error::NoLiveMember { .. }
            | Error::StillRunning { .. }
            | Error::NotCommitted { .. }
            // Not Unavailable: clients show that code as a transport failure.
            | Error::NodeDown { .. }
            | Error::Drained { .. }
            | Error::NoRoom { .. }
            | Error::Stopping => Code::FailedPrecondition,
            Error::Aborted { .. }
            | Error::PreCopyFailed { .. }
            | Error::RestartFailed { .. }
            | Error::LaunchFailed { .. }
            | Error::MigrationFailed { .. } => Code::Aborted,
            Error::NotOwner { .. } => Code::PermissionDenied,
            Error::Catalog(_) => Code::Internal,
        };
        tonic::Status::new(code, e.to_string())
    }
}
