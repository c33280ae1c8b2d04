//! The checkpoint image: one directory holding
//!
//! - `checkpoint.img`: a 32-byte header (magic, format version, payload
//!   length, XXH3-64 of the payload) followed by the protobuf
//!   `Checkpoint` message, which [`model`] turns into the typed, checked
//!   [`Checkpoint`] (the protobuf types never leave this crate);
//! - `pages-<ID>.img`: the page store, the unique pages of all processes
//!   in blocks, optionally compressed, each block with its XXH3-64 in the
//!   metadata (see [`store`]); an incremental image refers to its parent
//!   for unchanged pages (see [`chain`]).
//!
//! `checkpoint.img` is written last and renamed into place atomically: a
//! directory without it (or with a damaged one) is not an image. See
//! docs/IMAGE-FORMAT.md.
#![forbid(unsafe_code)]

pub mod bookmarks;
pub mod chain;
pub mod dir;
pub mod fuzz;
pub mod header;
pub mod model;
pub mod pages;
pub mod progress;
pub mod recovery;
pub mod show;
pub mod store;

pub use dir::ImageDir;
pub use model::Checkpoint;
pub use pages::{PageReader, PageWriter};

use std::path::PathBuf;

/// Major version of the image format: a reader refuses any other major.
pub const FORMAT_MAJOR: u16 = 3;
/// Minor version: a reader refuses a newer minor than its own. 3.1: an
/// image's parent pages' hashes are left to its parent (see
/// `Memory::parent_hashes_omitted`).
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
    #[error("{path} has image format version {major}.{minor}; this build reads {FORMAT_MAJOR}.0 to {FORMAT_MAJOR}.{FORMAT_MINOR}")]
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
    #[error("image {child} needs its parent {parent}: {what}")]
    Parent {
        child: PathBuf,
        parent: PathBuf,
        what: String,
    },
    #[error("image {path} is in use: {what}")]
    InUse { path: PathBuf, what: String },
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

/// A fresh random image id (32 hex digits).
pub fn new_image_id() -> String {
    let mut b = [0u8; 16];
    let got = std::fs::File::open("/dev/urandom").and_then(|mut f| {
        use std::io::Read;
        f.read_exact(&mut b)
    });
    if got.is_err() {
        // No /dev/urandom: time and pid are unique enough on one host.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        b = (t ^ ((std::process::id() as u128) << 64)).to_le_bytes();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// An error and its causes on one line.
pub fn one_line(e: &dyn std::error::Error) -> String {
    cr_sys::error::one_line(e)
}
