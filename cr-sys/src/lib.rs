//! The low-level layer of the checkpoint/restart engines, and the only crate
//! of the workspace allowed to use `unsafe`.
//!
//! - [`ptrace`]: a seized thread as a value whose `Drop` detaches it.
//! - [`remote`]: running system calls inside a stopped tracee.
//! - [`deadline`]: a per-thread timer that ends a blocking wait at a deadline.
//! - [`mem`]: reading and writing another process's memory.
//! - [`pagemap`]: which pages of a range are present, swapped or file pages.
//! - [`dirty`]: which pages a process wrote since a point in time
//!   (userfaultfd write-protect with PAGEMAP_SCAN, soft-dirty).
//! - [`proc`]: reading `/proc/PID/*` (with the `procfs` crate).
//! - [`elf`]: build ids of executables and of the vDSO (with `goblin`).
//! - [`clone`]: creating a process with a chosen PID (clone3 `set_tid`).
//! - [`coop`]: what libcr (application cooperation) needs: its signal handler, tgkill, dladdr.
//! - [`regs`]: the x86_64 register layouts ptrace uses.
//! - [`limits`]: resource limits of another process.
//! - [`sched`]: CPU affinity of any thread, the online CPUs.
//! - [`fdio`]: pipes, sockets and other fd objects the engines hold themselves.
//! - [`ptyq`]: the bytes queued in a pseudo-terminal pair, taken out and put back.
//! - [`inet`]: IPv4/IPv6 socket addresses and options, TCP repair mode.
//! - [`netlock`]: holding TCP connections still (nft) between dump and restore.
//! - [`sysv`]: System V shared memory, semaphores and message queues.
//! - [`mqueue`]: POSIX message queues another process holds.
//! - [`uffd`]: userfaultfd in missing mode for post-copy restore.
//! - [`ns`]: namespaces: another process's, its IPC namespace from a thread, a job's mounts.
//! - [`bpf`]: BPF maps: their attributes and entries, made again (bpf(2)).
//! - [`spank`]: Slurm's SPANK plugin interface (for the cr-spank plugin).

pub mod bpf;
pub mod capacity;
pub mod clone;
pub mod coop;
pub mod deadline;
pub mod dirty;
pub mod elf;
pub mod error;
pub mod fdio;
pub mod forged;
pub mod inet;
pub mod inet_diag;
pub mod limits;
pub mod mem;
pub mod mqueue;
pub mod netlink;
pub mod netlock;
pub mod ns;
pub mod packet;
pub mod pagemap;
pub mod proc;
pub mod ptrace;
pub mod ptyq;
pub mod regs;
pub mod remote;
pub mod rusage;
pub mod sched;
pub(crate) mod sock_diag;
pub mod spank;
pub mod sysv;
pub mod uffd;
pub mod unix_diag;

pub use error::{Errno, SysError};

/// Size of a page on x86_64.
pub const PAGE_SIZE: u64 = 4096;
