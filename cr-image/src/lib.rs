//! The checkpoint image: one directory holding
//!
//! - `checkpoint.img`: a 32-byte header (magic, format version, payload
//!   length, XXH3-64 of the payload) followed by the protobuf
//!   [`Checkpoint`](proto::Checkpoint) message;
//! - `pages-<PID>.img`: raw page data of one process, page aligned, so
//!   restore can read runs straight into place; every run carries its own
//!   XXH3-64 in the metadata.
//!
//! `checkpoint.img` is written last and renamed into place atomically: a
//! directory without it (or with a damaged one) is not an image. See
//! docs/IMAGE-FORMAT.md.
#![forbid(unsafe_code)]

pub mod bookmarks;
pub mod dir;
pub mod header;
pub mod pages;
pub mod progress;
pub mod show;

pub use cr_proto::image as proto;
pub use dir::ImageDir;
pub use pages::{PageReader, PageWriter};

use std::path::PathBuf;

/// Major version of the image format: a reader refuses any other major.
pub const FORMAT_MAJOR: u16 = 1;
/// Minor version: a reader refuses a newer minor than its own.
pub const FORMAT_MINOR: u16 = 1;

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("image directory {0} does not exist")]
    MissingDir(PathBuf),
    #[error("{0} is not a checkpoint image (no checkpoint.img)")]
    NotAnImage(PathBuf),
    #[error("i/o error on {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a checkpoint image file (bad magic)")]
    BadMagic { path: PathBuf },
    #[error("{path} has image format {major}.{minor}; this build reads {FORMAT_MAJOR}.0 to {FORMAT_MAJOR}.{FORMAT_MINOR}")]
    Version {
        path: PathBuf,
        major: u16,
        minor: u16,
    },
    #[error("{path} is truncated: {actual} bytes, expected {expected}")]
    Truncated {
        path: PathBuf,
        expected: u64,
        actual: u64,
    },
    #[error("{path} is damaged: checksum mismatch{context}")]
    Checksum { path: PathBuf, context: String },
    #[error("{path} is damaged: cannot decode metadata")]
    Decode {
        path: PathBuf,
        #[source]
        source: prost::DecodeError,
    },
    #[error("{path} is damaged: {what}")]
    Invalid { path: PathBuf, what: String },
}

pub type Result<T, E = ImageError> = std::result::Result<T, E>;

pub(crate) fn io_err(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> ImageError {
    let path = path.into();
    move |source| ImageError::Io { path, source }
}

/// XXH3-64 of a byte slice (the checksum used throughout the format).
pub fn checksum(data: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(data)
}
