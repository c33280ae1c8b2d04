//! cr-coordinatord: the coordinator of multi-node checkpoint/restart jobs
//! (docs/CLUSTER.md), and the library behind it, its admin client crctl and
//! `cr-bench coord`.
//!
//! * [`config`]: the config file and flags.
//! * [`catalog`]: the persistent catalog (redb): nodes, jobs, checkpoints.
//! * [`agents`]: [`AgentApi`], the agents as the protocol sees them, and
//!   [`GrpcAgents`], the real ones.
//! * [`coordinator`]: [`Coordinator`], its state and read-only views.
//! * [`registry`]: node registration, heartbeats, job membership.
//! * [`protocol`]: the coordinated checkpoint and restart.
//! * [`migrate`]: placement of a restart, migration and drain.
//! * [`precopy`]: pre-dump rounds while a job runs, before a checkpoint.
//! * [`recovery`]: uncoordinated checkpoints and the recovery line.
//! * [`schedule`]: periodic checkpoints.
//! * [`launch`]: remote starts of job members (`cr_rsh`).
//! * [`service`]: the gRPC Coordinator service (and who may call what:
//!   `cr_rpc::identity`).
//! * [`users`]: job requests an agent makes for one of its users.
//! * [`events`]: what happens, for `crctl watch` and `crctl status`.
//! * [`error`]: why a request failed.
//! * [`fault`]: fault points for the tests.
#![forbid(unsafe_code)]

pub mod agents;
pub mod catalog;
pub mod config;
pub mod coordinator;
pub mod error;
pub mod events;
pub mod fault;
pub mod launch;
pub mod migrate;
pub mod placement;
pub mod precopy;
pub mod protocol;
pub mod recovery;
pub mod registry;
pub mod schedule;
pub mod service;
pub mod users;

#[cfg(test)]
mod tests;

pub use agents::{AgentApi, AgentResult, GrpcAgents};
pub use catalog::{Catalog, CatalogError};
pub use coordinator::{Coordinator, Settings};
pub use cr_rpc::pb;
pub use error::Error;
/// For implementations of [`AgentApi`] outside this crate.
pub use tonic::async_trait;
