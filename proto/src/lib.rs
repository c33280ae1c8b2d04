//! Generated protobuf types. The image metadata lives in [`image`]; callers
//! convert these to domain types at the edge (see `cr-image`).
#![forbid(unsafe_code)]

/// `cr.image.v1`: the metadata of a checkpoint image.
pub mod image {
    include!(concat!(env!("OUT_DIR"), "/cr.image.v1.rs"));
}
