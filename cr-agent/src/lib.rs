//! The capture engine: freezes a process and writes its checkpoint image.
//!
//! Data flow of a checkpoint (module of each step):
//! 1. [`target`]: check the PID names a user process we can capture.
//! 2. [`fds`]: pre-flight of the open fds (refuse before freezing anything);
//!    on the frozen tree, their state: [`objects`] (pipes, memfds, deleted
//!    files), [`unix`] (unix sockets), [`locks`].
//! 3. [`threads`]: seize and interrupt every thread (`cr_sys::ptrace`);
//!    registers, XSAVE, signal mask, rseq per thread.
//! 4. [`capture`]: signal handlers, brk, and per thread the clear-child-tid
//!    address and sigaltstack by injected syscalls (`cr_sys::remote`); mm
//!    fields, cwd, umask, auxv from /proc.
//! 5. [`memory`]: classify the VMAs, find stored pages with pagemap and,
//!    for an incremental image, the pages unchanged since the parent
//!    ([`tracking`]); read, hash and store the others in parallel into the
//!    image's page store (`cr_image::store`).
//! 6. `cr_image::ImageDir::commit`, then continue, stop or kill the target.
//!
//! Any error before the end drops the seized thread, which detaches it: the
//! application runs on exactly as before.
//!
//! A coordinated checkpoint splits this in steps ([`capture::freeze`] with
//! the network lock, [`capture::Held::dump`], [`capture::Held::finish`]),
//! driven by the node agent daemon in [`agent`].
#![forbid(unsafe_code)]

pub mod agent;
pub mod capture;
pub mod error;
pub mod fault;
pub mod fds;
pub mod identity;
pub mod inet;
pub mod locks;
pub mod memory;
pub mod objects;
pub mod target;
pub mod threads;
pub mod tracking;
pub mod tree;
pub mod unix;

pub use capture::{checkpoint, Action, Options, Summary};
pub use error::CheckpointError;
