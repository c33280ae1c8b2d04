//! The checkpoint and restore engines.
//!
//! Every kind of resource a process holds has its own module under
//! [`kinds`], holding both its capture and its restore (and its round-trip
//! test); [`capture`] and [`restore`] are the short drivers that walk the
//! kinds in a fixed order. docs/ARCHITECTURE.md follows a checkpoint and a
//! restore step by step.
//!
//! - [`capture`]: freeze a tree, dump it kind by kind into an image, let it
//!   run on, stop or die ([`capture::checkpoint`], or in steps for the
//!   coordinated protocol: [`capture::freeze`] → [`capture::Held`]).
//! - [`restore`]: rebuild a tree from an image, frozen, then release it
//!   ([`restore::restore`], or [`restore::prepare`] → [`restore::Ready`]).
//! - [`verify`]: `--verify`, a tree captured again and compared with its
//!   image.
//! - [`check`]: what `cr_checkpoint --check` reports.
//! - [`coop`]: programs linked with libcr: their callbacks before the freeze,
//!   the outcome after the dump or the restore.
//! - [`options`]: what both are asked to do (also the tools' command lines).
//! - [`interrupt`]: Ctrl-C and SIGTERM stop the work cleanly.
//! - [`tracer`]: a frozen or rebuilt tree on a thread of its own, so that
//!   several are handled at once (the agent's sessions).
//!
//! The engines are safe Rust: every system call they need goes through
//! `cr_sys`, and every image value they use was checked by `cr_image`.
#![forbid(unsafe_code)]

mod asked;
pub mod capture;
pub mod check;
pub mod coop;
pub mod error;
pub mod fault;
pub mod interrupt;
pub mod kinds;
pub mod options;
mod pidstate;
mod probe;
pub mod restore;
mod stub;
pub mod tracer;
pub mod verify;

pub use capture::{checkpoint, Summary};
pub use error::{CheckpointError, RestoreError};
pub use options::{Action, CheckpointOptions, DirtyChoice, RestoreOptions};
pub use restore::restore;
