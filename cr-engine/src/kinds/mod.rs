//! One module (folder) per kind of resource a process holds. Each holds
//! the capture of its kind from a frozen process, its restore into a stub,
//! and its round-trip test; its section of the image is the file of the
//! same name in `cr_image::model`.
//!
//! Two patterns, each behind one small trait:
//!
//! - [`Kind`]: a section of every process (tree, task, memory, threads,
//!   signals, timers, identity, fds, cgroups). [`seccomp`] hooks in at fixed points
//!   of the threads' restore, as the very last system calls of each thread. The drivers (`capture::capture_process`
//!   and `restore::rebuild`) call them in a fixed order, one line each.
//! - [`FileKind`]: a kind of open file (files, pipes, unix, inet, netlink, packet, bpf (BPF maps), eventfds, mqueue,
//!   tty, external: what leads outside the tree; nsfds: fds of namespace files). [`FILE_KINDS`] lists them; the fd table ([`fds`]) asks each in
//!   turn whether an fd is of its kind, and later which one opens it again.
//!
//! [`locks`] (file locks, read with the fds that hold them), [`netlock`]
//! (holding TCP connections still between dump and restore) and [`drain`]
//! (before the freeze of a dump whose processes end, a short wait for the
//! program to take what is queued for it and cannot be saved) serve the
//! others. Three kinds belong to the whole tree rather than to a process:
//! [`sysv`] (System V IPC objects; the memory kind attaches the segments),
//! [`aio`] (AIO contexts, read from their rings with the mappings),
//! [`mounts`] (a job's own mount namespace) and [`uts`] (its own host
//! name), captured after the processes and made before any is rebuilt. [`outside`] records the files
//! outside the image the processes rely on, checked (or put back from the
//! image) before a restore begins. Adding a kind: its folder, its section in `cr_image::model` (and
//! `proto/image.proto`), and one line in a driver or in [`FILE_KINDS`].

pub mod aio;
pub mod bpf;
pub mod cgroups;
pub mod drain;
pub mod eventfds;
pub mod external;
pub mod fds;
pub mod files;
pub mod identity;
pub mod inet;
pub mod locks;
pub mod memory;
pub mod mounts;
pub mod mqueue;
pub mod netlink;
pub mod netlock;
pub mod netns;
pub mod nsfds;
pub mod outside;
pub mod packet;
pub mod pipes;
pub mod seccomp;
pub mod signals;
pub mod sockets;
pub mod sockopts;
pub mod sysv;
pub mod task;
pub mod threads;
pub mod timers;
pub mod tree;
pub mod tty;
pub mod unix;
pub mod uts;

#[cfg(test)]
pub(crate) mod testkit;

use crate::capture::Proc;
use crate::error::{CheckpointError, RestoreError};
use crate::restore::{Rebuild, Restorer};
use cr_image::model::{Checkpoint, Fd, FdKind, Process};
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::os::fd::OwnedFd;

/// A section of every process image.
pub trait Kind {
    /// Its name in logs and errors.
    const NAME: &'static str;
    /// Fill this kind's section of `p` from the frozen process `cx.pid`.
    fn capture(cx: &mut Proc<'_, '_>, p: &mut Process) -> Result<(), CheckpointError>;
    /// Give the stub `cx` this kind's saved state from `p`.
    fn restore(cx: &mut Rebuild<'_, '_, '_>, p: &Process) -> Result<(), RestoreError>;
}

/// A kind of open file.
pub trait FileKind: Sync {
    fn name(&self) -> &'static str;

    /// Whether `f` is of this kind (None: not mine) and then what it is
    /// (`Ok(None)`: it is gone meanwhile), or why it cannot be saved. With
    /// `cx.objects` (the tree is frozen), the state it shares with other
    /// fds is saved as an object too.
    fn describe(&self, cx: &mut fds::FdScan<'_>, f: &fds::OpenFd<'_>) -> Option<Described>;

    /// Create this kind's objects of the image in the restorer, before any
    /// process is rebuilt.
    fn prepare(&self, _r: &mut Restorer<'_>, _ck: &Checkpoint) -> Result<(), RestoreError> {
        Ok(())
    }

    /// Open fd `f` of `p` again (None: not mine).
    fn open(
        &self,
        cx: &mut Rebuild<'_, '_, '_>,
        p: &Process,
        f: &Fd,
    ) -> Option<Result<Opened, RestoreError>>;

    /// After every fd of `p` is open (epoll lists watch them).
    fn after_fds(&self, _cx: &mut Rebuild<'_, '_, '_>, _p: &Process) -> Result<(), RestoreError> {
        Ok(())
    }

    /// Just before the tree runs (timers armed, connections let out of
    /// repair mode).
    fn release(&self, _r: &mut Restorer<'_>) -> Result<(), RestoreError> {
        Ok(())
    }
}

/// The kinds of open files, in the order they are asked.
pub static FILE_KINDS: &[&dyn FileKind] = &[
    &pipes::Pipes,
    &unix::Unix,
    &inet::Inet,
    &sockets::RemadeKind::<netlink::Netlink>::new(),
    &sockets::RemadeKind::<packet::Packet>::new(),
    &bpf::Bpf,
    &eventfds::EventFds,
    &mqueue::Mqueues,
    &nsfds::NsFds,
    &tty::Tty,
    &external::External,
    &files::Files,
];

/// What a file kind says of an fd: what it is (None: gone meanwhile), or
/// why it cannot be saved.
pub type Described = Result<Option<FdKind>, String>;

/// How a file kind opened an fd again.
pub enum Opened {
    /// A description made in the restorer, which the stub takes.
    Ours(OwnedFd),
    /// Opened inside the stub, at its number, already.
    InStub,
    /// Opened later (a /dev/tty once the terminal is back).
    Later,
}

/// What the kinds keep for themselves during one checkpoint or restore,
/// one value per type (each kind declares its own).
#[derive(Default)]
pub struct Stash(HashMap<TypeId, Box<dyn Any>>);

impl Stash {
    /// This kind's value (made with `Default` on first use).
    pub fn get<T: Default + 'static>(&mut self) -> &mut T {
        self.0
            .entry(TypeId::of::<T>())
            .or_insert_with(|| Box::new(T::default()))
            .downcast_mut()
            .expect("a stash value has the type of its key")
    }

    pub fn peek<T: 'static>(&self) -> Option<&T> {
        self.0.get(&TypeId::of::<T>())?.downcast_ref()
    }

    pub fn take<T: 'static>(&mut self) -> Option<T> {
        self.0
            .remove(&TypeId::of::<T>())?
            .downcast()
            .ok()
            .map(|b| *b)
    }
}

/// Something a dump holds in the processes until they are let go (a TCP
/// connection in repair mode): dropping it gives it back as it was;
/// [`HeldState::keep`] leaves it so for processes about to be killed.
/// Between the dump and the let-go it is given back for the while
/// ([`HeldState::pause`]): should the checkpointer die meanwhile, the
/// processes run on as they were (a socket left in repair mode fails every
/// read with EPERM); `keep` takes it again first.
pub trait HeldState {
    fn keep(self: Box<Self>);
    fn pause(&mut self);
}
