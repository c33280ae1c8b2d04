//! What the socket kinds whose sockets are plain objects share (netlink,
//! packet): the restorer makes each object's socket before any process is
//! rebuilt, and every fd holding it gets a copy. Such a kind only says how
//! to make its objects and which fds are its own ([`Remade`]); [`RemadeKind`]
//! does the rest as a [`FileKind`].

use crate::error::RestoreError;
use crate::kinds::fds::{FdScan, OpenFd};
use crate::kinds::{Described, FileKind, Opened};
use crate::restore::{Rebuild, Restorer};
use cr_image::model::{Checkpoint, Fd, FdKind, Object, Process};
use std::collections::HashMap;
use std::marker::PhantomData;
use std::os::fd::OwnedFd;

/// A socket kind whose objects the restorer makes.
pub trait Remade: Sync + 'static {
    /// The kind's name in logs and errors.
    const NAME: &'static str;
    /// Make object `o` again (None: not of this kind).
    fn make(o: &Object) -> Option<Result<OwnedFd, RestoreError>>;
    /// The object an fd of this kind refers to (None: not of this kind).
    fn object(k: &FdKind) -> Option<u64>;
    /// After every fd of `p` is open (see [`FileKind::after_fds`]).
    fn after_fds(_cx: &mut Rebuild<'_, '_, '_>, _p: &Process) -> Result<(), RestoreError> {
        Ok(())
    }
}

/// The [`FileKind`] of a [`Remade`] kind. Its fds are described by the inet
/// kind, which tells every socket's family first.
pub struct RemadeKind<T>(PhantomData<T>);

impl<T> RemadeKind<T> {
    pub const fn new() -> Self {
        RemadeKind(PhantomData)
    }
}

impl<T> Default for RemadeKind<T> {
    fn default() -> Self {
        Self::new()
    }
}

/// The sockets made for kind `T`, by object.
struct Made<T>(HashMap<u64, OwnedFd>, PhantomData<T>);

impl<T> Default for Made<T> {
    fn default() -> Self {
        Made(HashMap::new(), PhantomData)
    }
}

impl<T: Remade> FileKind for RemadeKind<T> {
    fn name(&self) -> &'static str {
        T::NAME
    }

    fn describe(&self, _cx: &mut FdScan<'_>, _f: &OpenFd<'_>) -> Option<Described> {
        None
    }

    fn prepare(&self, r: &mut Restorer<'_>, ck: &Checkpoint) -> Result<(), RestoreError> {
        let made = r.stash.get::<Made<T>>();
        for o in &ck.objects {
            if let Some(sock) = T::make(o) {
                made.0.insert(o.id, sock?);
            }
        }
        Ok(())
    }

    fn open(
        &self,
        cx: &mut Rebuild<'_, '_, '_>,
        _p: &Process,
        f: &Fd,
    ) -> Option<Result<Opened, RestoreError>> {
        let object = T::object(&f.kind)?;
        Some(hand_over(cx.r.stash.get::<Made<T>>().0.get(&object), object).map(Opened::Ours))
    }

    fn after_fds(&self, cx: &mut Rebuild<'_, '_, '_>, p: &Process) -> Result<(), RestoreError> {
        T::after_fds(cx, p)
    }
}

/// A copy of socket `id` the restorer made (`made`), for a process to take.
pub fn hand_over(made: Option<&OwnedFd>, id: u64) -> Result<OwnedFd, RestoreError> {
    let s = made.ok_or_else(|| {
        RestoreError::Unsupported(format!("socket:[{id}] is missing from the image"))
    })?;
    s.try_clone()
        .map_err(|e| RestoreError::Unsupported(format!("cannot hand socket:[{id}] over: {e}")))
}
