//! Kind "tty": terminals. Pseudo-terminal pairs whose master the tree
//! holds are saved whole (index, termios, window size, lock state,
//! foreground group) and made again at the same index (in the job's own
//! devpts instance when it has one, see kind "mounts"); a session leader
//! gets its controlling terminal back, and /dev/tty fds are opened again
//! once it has. A terminal outside the tree (the one a job was started
//! from) leads outside: kind [`external`](crate::kinds::external).

#[cfg(test)]
mod tests;

use crate::error::{RestoreError, StepContext};
use crate::kinds::fds::{FdScan, OpenFd};
use crate::kinds::{external, files, Described, FileKind, Opened};
use crate::restore::{Rebuild, Restorer};
use cr_image::model::objects::Pty;
use cr_image::model::{Checkpoint, Fd, FdKind, Object, ObjectKind, Process};
use cr_sys::fdio;
use cr_sys::proc::{self, dev_major as major, FDTarget};
use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use tracing::warn;

pub struct Tty;

/// Terminal devices: the console and virtual terminals (4), /dev/tty,
/// console and ptmx (5), pty slaves (136-143).
fn is_tty_dev(rdev: u64) -> bool {
    matches!(major(rdev), 4 | 5 | 136..=143)
}

/// /dev/tty (5:0): the caller's controlling terminal.
fn is_dev_tty(rdev: u64) -> bool {
    proc::is_dev(rdev, 5, 0)
}

/// The index of the pty pair held by the tree that is the controlling
/// terminal `tty_nr` (field 7 of /proc/PID/stat), if it is one.
pub fn ctty_pty(tty_nr: u64, masters: &HashSet<u32>) -> Option<u32> {
    proc::pty_slave_index(tty_nr).filter(|i| masters.contains(i))
}

impl FileKind for Tty {
    fn name(&self) -> &'static str {
        "tty"
    }

    fn describe(&self, cx: &mut FdScan<'_>, f: &OpenFd<'_>) -> Option<Described> {
        if !matches!(f.target, FDTarget::Path(_)) {
            return None;
        }
        let md = f.md.as_ref()?;
        let r = md.rdev();
        if !md.file_type().is_char_device() || !is_tty_dev(r) {
            return None;
        }
        // /dev/tty of a process whose controlling terminal is a pty of the
        // tree: opened again by path once that pty is its terminal.
        if is_dev_tty(r) {
            let ctty = proc::stat(f.pid).map(|s| s.tty_nr as u64).unwrap_or(0);
            if ctty_pty(ctty, &cx.tree.pty_masters).is_some() {
                return Some(Ok(Some(FdKind::CharDevice { rdev: r })));
            }
        }
        let master = proc::is_dev(r, 5, 2);
        let index = if master {
            f.info
                .get("tty-index")
                .and_then(|v| v.trim().parse::<u32>().ok())
        } else {
            proc::pty_slave_index(r)
        };
        if let Some(index) = index.filter(|i| cx.tree.pty_masters.contains(i)) {
            if let Some(objs) = cx.objects.as_deref_mut() {
                if !objs.contains(cr_image::model::ObjectTag::Pty, index as u64) {
                    match pty_state(f, index, master) {
                        Ok(p) => objs.insert(Object {
                            id: index as u64,
                            kind: ObjectKind::Pty(p),
                        }),
                        Err(e) => return Some(Err(e)),
                    }
                }
            }
            return Some(Ok(Some(FdKind::Pty {
                object: index as u64,
                master,
            })));
        }
        if master {
            return Some(Err(format!(
                "the master of pseudo-terminal {} (not supported)",
                f.info.get("tty-index").unwrap_or("?")
            )));
        }
        Some(external::record(f, format!("the terminal {}", f.link)))
    }

    fn prepare(&self, r: &mut Restorer<'_>, ck: &Checkpoint) -> Result<(), RestoreError> {
        // A job's own devpts exists only once its mount namespace is made:
        // its ptys are made then (`kinds::mounts::prepare`).
        if ck.mounts.as_ref().is_some_and(|m| m.devpts) {
            return Ok(());
        }
        make_ptys(r, std::path::Path::new(cr_sys::ns::DEV_PTMX))
    }

    fn open(
        &self,
        cx: &mut Rebuild<'_, '_>,
        _p: &Process,
        f: &Fd,
    ) -> Option<Result<Opened, RestoreError>> {
        Some(match &f.kind {
            // /dev/tty waits until the controlling terminal is back.
            FdKind::CharDevice { rdev } if is_dev_tty(*rdev) => Ok(Opened::Later),
            FdKind::Pty { object, master } => pty_end(cx.r, f, *object, *master).map(Opened::Ours),
            _ => return None,
        })
    }
}

/// Make every pty pair of the image at its index through the multiplexer
/// `ptmx` (of the devpts the tree will see), with its settings; the
/// restorer holds the masters until the fds are opened.
pub fn make_ptys(r: &mut Restorer<'_>, ptmx: &std::path::Path) -> Result<(), RestoreError> {
    let ptmx = ptmx.to_string_lossy();
    let ck = r.ck;
    for o in &ck.objects {
        let ObjectKind::Pty(p) = &o.kind else {
            continue;
        };
        let what = || format!("cannot recreate pseudo-terminal {}", p.index);
        let m = fdio::open_pty_index(&ptmx, p.index).step(what)?;
        let slave = fdio::pty_peer(&m, libc::O_RDWR).step(what)?;
        if !p.termios.is_empty() {
            fdio::tcsets(slave.as_fd(), &p.termios).step(what)?;
        }
        if !p.winsize.is_empty() {
            fdio::set_winsize(&slave, &p.winsize).step(what)?;
        }
        if p.locked {
            fdio::set_pty_locked(&m, true).step(what)?;
        }
        r.stash.get::<Held>().0.insert(o.id, m);
    }
    Ok(())
}

/// The restorer's pty masters, by index.
#[derive(Default)]
struct Held(HashMap<u64, OwnedFd>);

/// The pty pair `index` (`f` is its master or a slave): terminal settings,
/// window size and foreground group. Bytes in flight in the pair's buffers
/// are not saved.
fn pty_state(f: &OpenFd<'_>, index: u32, master: bool) -> Result<Pty, String> {
    let err = |e: cr_sys::SysError| {
        format!(
            "pseudo-terminal {index}, whose state cannot be read: {}",
            cr_sys::error::one_line(&e)
        )
    };
    let fd = fdio::steal_fd(f.pid, f.fd).map_err(err)?;
    if master && fdio::pty_locked(&fd).map_err(err)? {
        return Ok(Pty {
            index,
            fg_pgrp: 0,
            termios: Vec::new(),
            winsize: Vec::new(),
            locked: true,
        });
    }
    let slave = if master {
        fdio::pty_peer(&fd, libc::O_RDONLY).map_err(err)?
    } else {
        fd
    };
    Ok(Pty {
        index,
        fg_pgrp: fdio::foreground(&slave).unwrap_or(0).max(0) as u32,
        termios: fdio::tcgets(&slave).map_err(err)?,
        winsize: fdio::get_winsize(&slave).unwrap_or_default(),
        locked: false,
    })
}

fn pty_end(
    r: &mut Restorer<'_>,
    f: &Fd,
    index: u64,
    master: bool,
) -> Result<OwnedFd, RestoreError> {
    let accmode = f.flags as i32 & libc::O_ACCMODE;
    let what = || format!("cannot open {} again as fd {}", f.path, f.fd);
    let m = r.stash.get::<Held>().0.get(&index).ok_or_else(|| {
        RestoreError::Unsupported(format!(
            "fd {} refers to pseudo-terminal {index}, missing from the image",
            f.fd
        ))
    })?;
    if master {
        m.try_clone()
            .map_err(|e| RestoreError::Unsupported(format!("{}: {e}", what())))
    } else {
        fdio::pty_peer(m, accmode).step(what)
    }
}

/// A session leader whose controlling terminal was a pty of the image takes
/// it again (TIOCSCTTY on one of its slave fds) and gives it its foreground
/// process group.
pub fn controlling_tty(cx: &mut Rebuild<'_, '_>, p: &Process) -> Result<(), RestoreError> {
    let Some(index) = p.ctty_pty else {
        return Ok(());
    };
    if cx.r.ids.sid_pgid(p).0 != cx.r.ids.inner(p.pid) {
        return Ok(());
    }
    let Some(slave) = p
        .fds
        .iter()
        .find(|f| matches!(f.kind, FdKind::Pty { object, master: false } if object == index))
    else {
        warn!(
            pid = p.pid,
            pty = index,
            "no slave fd left to make the controlling terminal again"
        );
        return Ok(());
    };
    cx.stub
        .call(
            "ioctl(TIOCSCTTY)",
            libc::SYS_ioctl,
            [slave.fd as u64, libc::TIOCSCTTY, 0, 0, 0, 0],
        )
        .step(|| {
            format!(
                "cannot make /dev/pts/{index} the controlling terminal of process {}",
                p.pid
            )
        })?;
    let fg =
        cx.r.ck
            .objects
            .iter()
            .find_map(|o| match &o.kind {
                ObjectKind::Pty(t) if o.id == index => Some(t.fg_pgrp),
                _ => None,
            })
            .unwrap_or(0);
    if fg != 0 {
        let pg = cx.r.ids.inner(fg);
        let addr = cx.stub.put(&pg.to_le_bytes())?;
        if let Err(e) = cx.stub.call(
            "ioctl(TIOCSPGRP)",
            libc::SYS_ioctl,
            [slave.fd as u64, libc::TIOCSPGRP, addr, 0, 0, 0],
        ) {
            warn!(pid = p.pid, pgrp = pg, error = %cr_sys::error::one_line(&e), "foreground group of the terminal not restored");
        }
    }
    Ok(())
}

/// Fd `fd` of `p` is a /dev/tty opened again only at the end.
pub fn deferred(p: &Process, fd: i32) -> bool {
    p.fd(fd).is_some_and(|f| {
        f.shared.is_none() && matches!(f.kind, FdKind::CharDevice { rdev } if is_dev_tty(rdev))
    })
}

/// The /dev/tty fds, opened again now that the process's session has its
/// controlling terminal back (and the fds that share them).
pub fn reopen_dev_tty(cx: &mut Rebuild<'_, '_>, p: &Process) -> Result<(), RestoreError> {
    for f in p.fds.iter().filter(|f| deferred(p, f.fd)) {
        files::reopen(cx, f, libc::O_NOCTTY)?;
        for d in p
            .fds
            .iter()
            .filter(|d| d.shared.is_some_and(|s| s.pid == p.pid && s.fd == f.fd))
        {
            let cloexec = ((d.flags as i32) & libc::O_CLOEXEC) as u64;
            cx.stub
                .call(
                    "dup3",
                    libc::SYS_dup3,
                    [f.fd as u64, d.fd as u64, cloexec, 0, 0, 0],
                )
                .step(|| format!("cannot share /dev/tty as fd {}", d.fd))?;
        }
    }
    Ok(())
}

/// Make the restored job (its process group) the foreground job of our
/// terminal, as the shell had made it before the checkpoint.
pub fn take_terminal(root: i32) {
    let Some(tty) = [0, 1, 2]
        .into_iter()
        .filter_map(|fd| fdio::dup_own(fd).ok())
        .find(|fd| fdio::is_tty(fd.as_fd()))
    else {
        warn!("--shell-job: cr_restart has no terminal to hand over");
        return;
    };
    let pgrp = proc::stat(root).map(|s| s.pgrp).unwrap_or(root);
    if let Err(e) = fdio::set_foreground(tty.as_fd(), pgrp) {
        warn!(error = %cr_sys::error::one_line(&e), "--shell-job: cannot make the job the foreground job");
    }
}
