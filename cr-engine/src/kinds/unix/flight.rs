//! Files in flight over unix sockets (SCM_RIGHTS) at restore.
//!
//! The image holds each file a queued message carried as an fd of its own
//! kind (captured from the copy a peek put in the checkpointer's table).
//! A file the tree held too (the sender kept it) is the same open file
//! description again: taken from the rebuilt process once its fds are
//! open. Any other is opened by its kind in the root's stub (at a spare
//! number, then taken by the restorer and closed there). The queues that
//! carry files are written once every file is open again (after the
//! last process that gives one is rebuilt; [`super::rebuild::finish`]);
//! the restorer's copies are closed then, the messages holding the files
//! as the original queue did.

use super::rebuild::Later;
use crate::error::{RestoreError, StepContext};
use crate::kinds::{Opened, FILE_KINDS};
use crate::restore::Rebuild;
use cr_image::model::{Checkpoint, Fd, FdKind, ObjectKind, Process};
use cr_sys::fdio;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};

/// Socket id -> message -> the files it carries, by place.
pub type Files<T> = HashMap<u64, HashMap<u32, Vec<T>>>;

/// What waits in the restorer for the files in flight.
#[derive(Default)]
pub struct Flying {
    pub later: Option<Later>,
    pub files: Files<Option<OwnedFd>>,
}

/// The files in flight `p` (just rebuilt, every fd open) gives: those it
/// holds itself, and (the root) those no process holds.
pub fn open(cx: &mut Rebuild<'_, '_, '_>, p: &Process) -> Result<(), RestoreError> {
    let ck: &Checkpoint = cx.r.ck;
    let pid = cx.stub.pid();
    let grab = cx.stub.grab_pidfd;
    let spare = (p.fds.last().map_or(0, |f| f.fd + 1)..)
        .find(|&n| !crate::kinds::fds::needed(p, n) && grab != Some(n as u64))
        .unwrap_or(0);
    for o in &ck.objects {
        let ObjectKind::UnixSocket(u) = &o.kind else {
            continue;
        };
        for m in &u.in_flight {
            for f in &m.fds {
                let got = match f.shared {
                    Some(s) if s.pid == p.pid => Some(fdio::steal_fd(pid, s.fd).step(|| {
                        format!(
                            "cannot take fd {} of process {} to send it again over socket:[{}]",
                            s.fd, p.pid, o.id
                        )
                    })?),
                    None if cx.is_root => Some(open_one(cx, p, f, spare, o.id)?),
                    _ => None,
                };
                if let Some(file) = got {
                    let flying = cx.r.stash.get::<Flying>();
                    let slots = flying
                        .files
                        .entry(o.id)
                        .or_default()
                        .entry(m.message)
                        .or_insert_with(|| m.fds.iter().map(|_| None).collect());
                    if let Some(slot) = slots.get_mut(f.fd as usize) {
                        *slot = Some(file);
                    }
                }
            }
        }
    }
    Ok(())
}

/// Open file `f` in flight by its kind, in the stub of `p` at fd `spare`
/// if it opens there; the restorer's copy.
fn open_one(
    cx: &mut Rebuild<'_, '_, '_>,
    p: &Process,
    f: &Fd,
    spare: i32,
    sock: u64,
) -> Result<OwnedFd, RestoreError> {
    let mut at = f.clone();
    at.fd = spare;
    let opened = FILE_KINDS
        .iter()
        .find_map(|k| k.open(cx, p, &at))
        .unwrap_or_else(|| {
            Err(RestoreError::Unsupported(format!(
                "a file in flight over socket:[{sock}] is of kind {} (no kind of this build opens it)",
                f.kind.name()
            )))
        })?;
    match opened {
        Opened::Ours(fd) if matches!(f.kind, FdKind::Epoll { .. }) => watch(cx, p, f, fd, spare),
        Opened::Ours(fd) => Ok(fd),
        Opened::InStub => {
            take_back(cx, spare, || {
                format!("cannot take {} in flight over socket:[{sock}]", f.path)
            })
        }
        Opened::Later => Err(RestoreError::Unsupported(format!(
            "{} in flight over socket:[{sock}] (a file opened only once the terminal is back, or a pidfd of a thread, opened once the threads exist; not supported)",
            f.path
        ))),
    }
}

/// Epoll `fd` in flight (`f`), its interest list registered again in the
/// stub of the root `p` (its keys are the root's fd numbers), where it
/// stays at a number neither the root nor a key uses (from `spare`) for
/// the while.
fn watch(
    cx: &mut Rebuild<'_, '_, '_>,
    p: &Process,
    f: &Fd,
    fd: OwnedFd,
    spare: i32,
) -> Result<OwnedFd, RestoreError> {
    let FdKind::Epoll { items } = &f.kind else {
        return Ok(fd);
    };
    let grab = cx.stub.grab_pidfd;
    let at = (spare..)
        .find(|&n| {
            !crate::kinds::fds::needed(p, n)
                && grab != Some(n as u64)
                && items.iter().all(|it| it.tfd != n)
        })
        .unwrap_or(spare);
    let what = || {
        format!(
            "cannot watch again what the epoll {} in flight watched",
            f.path
        )
    };
    cx.stub.grab(fd.as_raw_fd(), at, true).step(what)?;
    cx.stub.flush().step(what)?;
    drop(fd);
    let mut here = f.clone();
    here.fd = at;
    crate::kinds::eventfds::watch(cx, p, &here, None)?;
    take_back(cx, at, what)
}

/// Fd `at` of the stub, taken into the restorer and closed in the stub.
fn take_back(
    cx: &mut Rebuild<'_, '_, '_>,
    at: i32,
    what: impl Fn() -> String,
) -> Result<OwnedFd, RestoreError> {
    let back = fdio::steal_fd(cx.stub.pid(), at).step(&what)?;
    cx.stub
        .call("close", libc::SYS_close, [at as u64, 0, 0, 0, 0, 0])
        .step(what)?;
    Ok(back)
}

/// Whether every file in flight is open again.
pub fn all_open(ck: &Checkpoint, got: &Files<Option<OwnedFd>>) -> bool {
    ck.objects.iter().all(|o| {
        let ObjectKind::UnixSocket(u) = &o.kind else {
            return true;
        };
        u.in_flight.iter().all(|m| {
            got.get(&o.id)
                .and_then(|by| by.get(&m.message))
                .is_some_and(|slots| {
                    slots.len() == m.fds.len() && slots.iter().all(Option::is_some)
                })
        })
    })
}

/// Every file in flight, each opened again; or which one is missing.
pub fn check_all(
    ck: &Checkpoint,
    mut got: Files<Option<OwnedFd>>,
) -> Result<Files<OwnedFd>, RestoreError> {
    let mut out: Files<OwnedFd> = HashMap::new();
    for o in &ck.objects {
        let ObjectKind::UnixSocket(u) = &o.kind else {
            continue;
        };
        for m in &u.in_flight {
            let slots = got
                .get_mut(&o.id)
                .and_then(|by| by.remove(&m.message))
                .unwrap_or_default();
            if let Some(f) = (0..m.fds.len())
                .find(|&i| !matches!(slots.get(i), Some(Some(_))))
                .map(|i| &m.fds[i])
            {
                return Err(RestoreError::Unsupported(format!(
                    "{} in flight over socket:[{}] was not opened again{}",
                    f.path,
                    o.id,
                    f.shared
                        .map(|s| format!(" (fd {} of process {})", s.fd, s.pid))
                        .unwrap_or_default()
                )));
            }
            let files: Vec<OwnedFd> = slots.into_iter().flatten().collect();
            out.entry(o.id).or_default().insert(m.message, files);
        }
    }
    Ok(out)
}
