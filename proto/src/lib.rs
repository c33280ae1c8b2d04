//! Generated protobuf types of the gRPC services of a cluster
//! (coordinator, agent, local clients): [`cluster`]. (The image metadata,
//! `image.proto`, is compiled by the image crate, which keeps it private.)
//! Also [`coop`], the line protocol between a checkpointer and libcr in a
//! program that takes part in its checkpoints.
#![forbid(unsafe_code)]

pub mod coop;

/// Default path of a cr-agent's Unix socket for local clients.
pub const AGENT_SOCKET: &str = "/run/cr/agent.sock";
/// Environment variable naming the agent's Unix socket for local clients.
pub const AGENT_SOCKET_ENV: &str = "CR_AGENT_SOCKET";

/// The agent's Unix socket for local clients: `CR_AGENT_SOCKET` or the default.
pub fn agent_socket() -> std::path::PathBuf {
    std::env::var_os(AGENT_SOCKET_ENV)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(AGENT_SOCKET))
}

/// `cr.cluster.v1`: the Coordinator, Agent and Local services (feature
/// `grpc`: libcr, which only speaks [`coop`], links no gRPC stack).
#[cfg(feature = "grpc")]
pub mod cluster {
    #![allow(clippy::all)]
    include!(concat!(env!("OUT_DIR"), "/cr.cluster.v1.rs"));
}
