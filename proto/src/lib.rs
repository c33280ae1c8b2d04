//! Generated protobuf types of the gRPC services of a cluster
//! (coordinator, agent, local clients): [`cluster`]. (The image metadata,
//! `image.proto`, is compiled by the image crate, which keeps it private.)
//! Also [`coop`], the line protocol between a checkpointer and libcr in a
//! program that takes part in its checkpoints.
#![forbid(unsafe_code)]

pub mod coop;

/// `cr.cluster.v1`: the Coordinator, Agent and Local services.
pub mod cluster {
    #![allow(clippy::all)]
    include!(concat!(env!("OUT_DIR"), "/cr.cluster.v1.rs"));
}
