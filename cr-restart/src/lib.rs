//! The restore engine: recreates a checkpointed process with its PID.
//!
//! Data flow of a restore (module of each step):
//! 1. `cr_image`: read and verify the metadata; open the page file.
//!    [`objects`] and [`unix`]: pipes, FIFOs, unix sockets, memfds and
//!    deleted files are created in the restorer, refilled with their data.
//! 2. [`restore`]: create a stub with the saved PID (`cr_sys::clone`),
//!    seize it (killed if we die), unregister its rseq, map a scratch area,
//!    close its fds, unmap all its memory but the vDSO, move the vDSO to the
//!    saved address.
//! 3. [`memory`]: map every saved VMA, fill stored pages from the page file
//!    (checksums verified run by run) with several threads, then put back
//!    protections, madvise flags and names.
//! 4. [`fds`]: reopen files at their numbers, flags and offsets; take the
//!    other fds from the restorer (pidfd_getfd); epoll lists and locks.
//! 5. [`restore`]: cwd, umask, personality, PR_SET_MM_MAP (mm fields, auxv,
//!    exe), comm, signal handlers, rseq, signal mask.
//! 6. [`identity`]: resource limits, then credentials and capabilities of
//!    every thread, after every privileged step.
//! 7. [`regs`]: registers with syscall-restart fix-ups and the XSAVE area;
//!    then detach. Nothing of the process ran before this last step, so a
//!    failure anywhere kills the stub and leaves nothing behind.
#![forbid(unsafe_code)]

pub mod error;
pub mod fds;
pub mod identity;
pub mod inet;
pub mod memory;
pub mod objects;
pub mod regs;
pub mod restore;
pub mod unix;

pub use error::RestoreError;
pub use restore::{restore, Options};
