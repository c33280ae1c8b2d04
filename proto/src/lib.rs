//! Generated protobuf types. The image metadata lives in [`image`]; callers
//! convert these to domain types at the edge (see `cr-image`). The gRPC
//! services of a cluster (coordinator, agent, local clients) live in
//! [`cluster`].
#![forbid(unsafe_code)]

/// `cr.image.v1`: the metadata of a checkpoint image.
pub mod image {
    include!(concat!(env!("OUT_DIR"), "/cr.image.v1.rs"));
}

/// `cr.cluster.v1`: the Coordinator, Agent and Local services.
pub mod cluster {
    #![allow(clippy::all)]
    include!(concat!(env!("OUT_DIR"), "/cr.cluster.v1.rs"));
}
