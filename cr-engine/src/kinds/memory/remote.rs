//! Page stores that arrive while a restore reads them (post-copy between
//! nodes: `crctl migrate --lazy`).
//!
//! The image's metadata is here, its page store file exists at its full
//! size, but its blocks are written into it as they come from the node
//! that made the image. Whoever fetches them (the agent) implements
//! [`RemoteStores`] and hands it to the restore
//! ([`crate::options::RestoreOptions::remote_pages`]); every read of a
//! block goes through [`super::fill::Pages`], which asks first. A store
//! the implementation does not know is taken as complete.

use std::path::Path;

/// Blocks of page stores still on their way.
pub trait RemoteStores: Send + Sync + std::fmt::Debug {
    /// Whether block `block` of store file `store` (canonical path) is in;
    /// why it never will be (the source is lost).
    fn has(&self, store: &Path, block: u32) -> Result<bool, String>;
    /// Ask for block `block` of `store` before any other and wait until it
    /// is in; why it never will (the source is lost).
    fn wait(&self, store: &Path, block: u32) -> Result<(), String>;
    /// Ask for these blocks of `store` before the rest, without waiting
    /// (the restore is about to read them all).
    fn want(&self, store: &Path, blocks: &[u32]);
}
