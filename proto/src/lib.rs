//! Generated protobuf types of the gRPC services of a cluster
//! (coordinator, agent, local clients): [`cluster`]. (The image metadata,
//! `image.proto`, is compiled by the image crate, which keeps it private.)
#![forbid(unsafe_code)]

/// `cr.cluster.v1`: the Coordinator, Agent and Local services.
pub mod cluster {
    #![allow(clippy::all)]
    include!(concat!(env!("OUT_DIR"), "/cr.cluster.v1.rs"));
}
