//! File descriptors of a restored process.
//!
//! - Files and directories are reopened inside the process by path, with
//!   their flags and offset.
//! - An fd sharing its open file description with an fd restored before it
//!   (dup, or inherited across fork) is shared again: dup3, or pidfd_getfd
//!   from the other process.
//! - Everything else (pipes, sockets, eventfd, timerfd, signalfd, epoll,
//!   inotify, memfds, deleted files, fds inherited from outside) is created
//!   in the restorer and taken by the process with pidfd_getfd through a
//!   pidfd of the restorer it inherited ([`Stub::grab`]); then its status
//!   flags are set again with F_SETFL.
//! - Last, the epoll interest lists (the watched fds must exist) and the
//!   file locks.

use crate::error::{RestoreError, StepContext};
use crate::objects::Objects;
use crate::restore::{Ids, Stub};
use cr_image::proto;
use cr_sys::fdio;
use proto::FdKind;
use std::os::fd::{AsRawFd, OwnedFd};
use tracing::warn;

/// Open flags that must not be replayed (they act only at open time).
const OPEN_ONLY: i32 = libc::O_CREAT | libc::O_EXCL | libc::O_TRUNC | libc::O_NOCTTY;

/// What the restorer must keep until the release: the timerfds to arm at
/// the very end.
#[derive(Default)]
pub struct Handoff {
    timers: Vec<(OwnedFd, proto::TimerFd)>,
}

impl Handoff {
    /// Arm the timerfds with the time they had left.
    pub fn arm_timers(&mut self) -> Result<(), RestoreError> {
        for (fd, t) in self.timers.drain(..) {
            let what = || format!("cannot arm a timerfd (clock {})", t.clockid);
            // A periodic timer that expired and was not read since is not
            // re-armed by the kernel until it is read: its time left shows
            // 0 but it still runs, one period from now.
            let value = match (t.value_ns, t.interval_ns) {
                (0, 0) => {
                    if t.ticks != 0 {
                        fdio::timerfd_set_ticks(&fd, t.ticks).step(what)?;
                    }
                    continue;
                }
                (0, period) => period,
                (v, _) => v,
            };
            let abs = t.settime_flags as i32 & libc::TFD_TIMER_ABSTIME != 0;
            let flags = if abs && t.value_ns == 0 {
                t.settime_flags as i32 & !libc::TFD_TIMER_ABSTIME
            } else {
                t.settime_flags as i32
            };
            fdio::timerfd_settime(&fd, flags, value, t.interval_ns).step(what)?;
            // After settime, which clears them.
            if t.ticks != 0 {
                fdio::timerfd_set_ticks(&fd, t.ticks).step(what)?;
            }
        }
        Ok(())
    }
}

/// Options of the fds restore.
#[derive(Debug, Clone, Copy, Default)]
pub struct FdOptions {
    /// Terminal settings of inherited terminals are applied to ours.
    pub shell_job: bool,
}

/// Restore `fds` of image process `pid` inside its stub.
pub fn restore(
    stub: &mut Stub<'_>,
    pid: u32,
    fds: &[proto::Fd],
    ids: &Ids,
    objects: &Objects,
    handoff: &mut Handoff,
    opts: FdOptions,
) -> Result<(), RestoreError> {
    for f in fds {
        let kind = FdKind::try_from(f.kind).unwrap_or(FdKind::Unspecified);
        let flags = (f.flags as i32) & !OPEN_ONLY;
        let cloexec = (flags & libc::O_CLOEXEC) as u64;
        if f.shared_pid != 0 {
            if f.shared_pid == pid && deferred_tty(fds, f.shared_fd) {
                continue; // dup'ed after /dev/tty is opened again
            }
            share(stub, pid, f, cloexec, ids)?;
            continue;
        }
        let ours = match kind {
            // /dev/tty waits until the controlling terminal is back.
            FdKind::CharDevice if is_dev_tty(f.rdev) => continue,
            FdKind::Regular | FdKind::Directory | FdKind::CharDevice => {
                reopen(stub, f, kind, flags, cloexec)?;
                continue;
            }
            FdKind::Pipe
            | FdKind::Pty
            | FdKind::Fifo
            | FdKind::Memfd
            | FdKind::DeletedFile
            | FdKind::UnixSocket
            | FdKind::InetSocket => objects.description(f)?,
            FdKind::Eventfd => {
                let sem = if f.eventfd_semaphore {
                    libc::EFD_SEMAPHORE
                } else {
                    0
                };
                fdio::eventfd(f.eventfd_count, sem)
                    .step(|| format!("cannot create eventfd {}", f.fd))?
            }
            FdKind::Signalfd => {
                fdio::signalfd(f.sigmask, 0).step(|| format!("cannot create signalfd {}", f.fd))?
            }
            FdKind::Timerfd => {
                let t = f.timerfd.unwrap_or_default();
                let fd = fdio::timerfd(t.clockid, 0)
                    .step(|| format!("cannot create timerfd {} (clock {})", f.fd, t.clockid))?;
                let copy = fd
                    .try_clone()
                    .map_err(|e| RestoreError::Unsupported(e.to_string()))?;
                handoff.timers.push((copy, t));
                fd
            }
            FdKind::Epoll => {
                fdio::epoll_create().step(|| format!("cannot create epoll {}", f.fd))?
            }
            FdKind::Inotify => inotify(f)?,
            FdKind::Inherited => inherited(f, opts)?,
            FdKind::Unspecified => {
                return Err(RestoreError::Unsupported(format!(
                    "fd {} of process {pid} is of kind {} (not supported by this version)",
                    f.fd, f.kind
                )))
            }
        };
        stub.grab(ours.as_raw_fd(), f.fd, cloexec != 0)
            .step(|| format!("cannot hand {} to process {pid} as fd {}", f.path, f.fd))?;
        let settable =
            libc::O_APPEND | libc::O_ASYNC | libc::O_DIRECT | libc::O_NOATIME | libc::O_NONBLOCK;
        stub.call(
            "fcntl(F_SETFL)",
            libc::SYS_fcntl,
            [
                f.fd as u64,
                libc::F_SETFL as u64,
                (flags & settable) as u64,
                0,
                0,
                0,
            ],
        )
        .step(|| format!("cannot set the flags of fd {}", f.fd))?;
        if matches!(kind, FdKind::Memfd | FdKind::DeletedFile) && f.pos != 0 {
            seek(stub, f)?;
        }
        // The process holds it now; ours would only cost an fd.
        drop(ours);
    }
    for f in fds {
        if !f.epoll.is_empty() && f.shared_pid == 0 {
            epoll(stub, f)?;
        }
    }
    for f in fds {
        locks(stub, f)?;
    }
    Ok(())
}

fn seek(stub: &mut Stub<'_>, f: &proto::Fd) -> Result<(), RestoreError> {
    stub.call(
        "lseek",
        libc::SYS_lseek,
        [f.fd as u64, f.pos, libc::SEEK_SET as u64, 0, 0, 0],
    )
    .step(|| format!("cannot seek fd {} ({}) to {}", f.fd, f.path, f.pos))?;
    Ok(())
}

/// A file, directory or device opened again by path.
fn reopen(
    stub: &mut Stub<'_>,
    f: &proto::Fd,
    kind: FdKind,
    flags: i32,
    cloexec: u64,
) -> Result<(), RestoreError> {
    if kind == FdKind::Regular {
        match std::fs::metadata(&f.path) {
            Ok(md) if md.len() < f.pos => warn!(
                fd = f.fd,
                path = f.path,
                size = md.len(),
                pos = f.pos,
                "file is shorter than the saved offset"
            ),
            _ => {}
        }
    }
    let got = stub
        .open(&f.path, flags)
        .step(|| format!("cannot reopen {} as fd {}", f.path, f.fd))?;
    if got != f.fd as u64 {
        stub.call("dup3", libc::SYS_dup3, [got, f.fd as u64, cloexec, 0, 0, 0])
            .step(|| format!("cannot move {} to fd {}", f.path, f.fd))?;
        stub.call("close", libc::SYS_close, [got, 0, 0, 0, 0, 0])?;
    }
    if kind == FdKind::Regular || (kind == FdKind::Directory && f.pos != 0) {
        seek(stub, f)?;
    }
    Ok(())
}

/// An inotify instance with its watches at their saved numbers: watch
/// descriptors are handed out cyclically, so a watch that came out too low
/// is removed and added again until it gets its number.
fn inotify(f: &proto::Fd) -> Result<OwnedFd, RestoreError> {
    let fd =
        fdio::inotify_init(libc::IN_NONBLOCK).step(|| format!("cannot create inotify {}", f.fd))?;
    let mut watches = f.inotify.clone();
    watches.sort_by_key(|w| w.wd);
    for w in &watches {
        let what = || format!("cannot watch {} again (inotify fd {})", w.path, f.fd);
        loop {
            let got = fdio::inotify_add_watch(&fd, &w.path, w.mask).step(what)?;
            if got == w.wd {
                break;
            }
            if got > w.wd {
                return Err(RestoreError::Unsupported(format!(
                    "{}: got watch {got} instead of {}",
                    what(),
                    w.wd
                )));
            }
            fdio::inotify_rm_watch(&fd, got).step(what)?;
        }
    }
    // Each removed stand-in queued an IN_IGNORED event: drop them.
    let mut buf = [0u8; 4096];
    while fdio::read_nonblock(&fd, &mut buf).is_ok_and(|n| n > 0) {}
    Ok(fd)
}

/// An fd that led outside the tree: our own fd of the same number (for a
/// terminal, our terminal), or /dev/null if we have none.
fn inherited(f: &proto::Fd, opts: FdOptions) -> Result<OwnedFd, RestoreError> {
    let tty = !f.termios.is_empty();
    // A terminal prefers our terminal (the same number first, then any of
    // 0, 1, 2); otherwise, or if we have none, our fd of the same number (a
    // file or pipe we were given).
    let mut candidates: Vec<(i32, bool)> = Vec::new();
    if tty {
        candidates.extend([(f.fd, true), (0, true), (1, true), (2, true)]);
    }
    if f.fd <= 2 {
        candidates.push((f.fd, false));
    }
    for (c, want_tty) in candidates {
        if c > 2 {
            continue;
        }
        let Ok(dup) = fdio::dup_own(c) else { continue };
        let ours_tty = fdio::is_tty(std::os::fd::AsFd::as_fd(&dup));
        if want_tty && !ours_tty {
            continue;
        }
        if ours_tty && tty && opts.shell_job {
            if let Err(e) = fdio::tcsets(std::os::fd::AsFd::as_fd(&dup), &f.termios) {
                warn!(fd = f.fd, error = %cr_sys::error::one_line(&e), "terminal settings not restored");
            }
        }
        return Ok(dup);
    }
    warn!(
        fd = f.fd,
        was = f.path,
        "no fd of ours to give in its place: /dev/null"
    );
    let accmode = f.flags as i32 & libc::O_ACCMODE;
    fdio::open("/dev/null", accmode).step(|| "cannot open /dev/null".into())
}

/// The epoll interest list, registered inside the process so each item
/// carries the process's own fd number.
fn epoll(stub: &mut Stub<'_>, f: &proto::Fd) -> Result<(), RestoreError> {
    for it in &f.epoll {
        // struct epoll_event is packed on x86_64: u32 events, u64 data.
        let mut ev = Vec::with_capacity(12);
        ev.extend_from_slice(&it.events.to_le_bytes());
        ev.extend_from_slice(&it.data.to_le_bytes());
        let addr = stub.put(&ev)?;
        stub.call(
            "epoll_ctl",
            libc::SYS_epoll_ctl,
            [
                f.fd as u64,
                libc::EPOLL_CTL_ADD as u64,
                it.tfd as u64,
                addr,
                0,
                0,
            ],
        )
        .step(|| format!("cannot watch fd {} again in epoll fd {}", it.tfd, f.fd))?;
    }
    Ok(())
}

/// Take the locks this fd held again. flock and OFD locks belong to the
/// open file description (taken once, by its first holder); POSIX locks to
/// the process.
fn locks(stub: &mut Stub<'_>, f: &proto::Fd) -> Result<(), RestoreError> {
    for l in &f.locks {
        let kind = proto::LockKind::try_from(l.kind).unwrap_or(proto::LockKind::Unspecified);
        let what = || {
            format!(
                "cannot take the {} lock on {} (fd {}) again: is it held by another process?",
                kind.as_str_name().to_lowercase(),
                f.path,
                f.fd
            )
        };
        match kind {
            proto::LockKind::Flock if f.shared_pid == 0 => {
                let op = if l.lock_type == libc::F_WRLCK as u32 {
                    libc::LOCK_EX
                } else {
                    libc::LOCK_SH
                } | libc::LOCK_NB;
                stub.call(
                    "flock",
                    libc::SYS_flock,
                    [f.fd as u64, op as u64, 0, 0, 0, 0],
                )
                .step(what)?;
            }
            proto::LockKind::Posix | proto::LockKind::Ofd => {
                if kind == proto::LockKind::Ofd && f.shared_pid != 0 {
                    continue;
                }
                // struct flock: short l_type, short l_whence, off_t l_start,
                // off_t l_len, pid_t l_pid (32 bytes with padding).
                let mut fl = vec![0u8; 32];
                fl[0..2].copy_from_slice(&(l.lock_type as i16).to_le_bytes());
                fl[2..4].copy_from_slice(&(libc::SEEK_SET as i16).to_le_bytes());
                fl[8..16].copy_from_slice(&l.start.to_le_bytes());
                fl[16..24].copy_from_slice(&l.len.to_le_bytes());
                let addr = stub.put(&fl)?;
                let cmd = if kind == proto::LockKind::Posix {
                    libc::F_SETLK
                } else {
                    libc::F_OFD_SETLK
                };
                stub.call(
                    "fcntl(F_SETLK)",
                    libc::SYS_fcntl,
                    [f.fd as u64, cmd as u64, addr, 0, 0, 0],
                )
                .step(what)?;
            }
            _ => {}
        }
    }
    Ok(())
}

/// An fd sharing its open file description with an fd restored before it:
/// dup'ed in the same process, or taken from the other process with
/// pidfd_getfd (the same description, so the offset stays shared).
fn share(
    stub: &mut Stub<'_>,
    pid: u32,
    f: &proto::Fd,
    cloexec: u64,
    ids: &Ids,
) -> Result<(), RestoreError> {
    let what = || {
        format!(
            "cannot share fd {} of process {} as fd {}",
            f.shared_fd, f.shared_pid, f.fd
        )
    };
    if f.shared_pid == pid {
        stub.call(
            "dup3",
            libc::SYS_dup3,
            [f.shared_fd as u64, f.fd as u64, cloexec, 0, 0, 0],
        )
        .step(what)?;
        return Ok(());
    }
    // pidfd_open runs inside the stub: the owner's PID as the stub sees it.
    let owner = ids.inner(f.shared_pid) as u64;
    let pidfd = stub
        .call("pidfd_open", libc::SYS_pidfd_open, [owner, 0, 0, 0, 0, 0])
        .step(what)?;
    let got = stub.call(
        "pidfd_getfd",
        libc::SYS_pidfd_getfd,
        [pidfd, f.shared_fd as u64, 0, 0, 0, 0],
    );
    stub.call("close", libc::SYS_close, [pidfd, 0, 0, 0, 0, 0])?;
    let got = got.step(what)?;
    stub.place(got, f.fd, cloexec != 0).step(what)?;
    Ok(())
}

/// A session leader whose controlling terminal was a pty of the image takes
/// it again (TIOCSCTTY on one of its slave fds) and gives it its foreground
/// process group.
pub fn controlling_tty(
    stub: &mut Stub<'_>,
    p: &proto::Process,
    ids: &Ids,
    fg_pgrp: u32,
) -> Result<(), RestoreError> {
    let index = p.ctty_pty as u64 - 1;
    let Some(slave) = p.fds.iter().find(|f| {
        f.kind == FdKind::Pty as i32 && f.object == index && !crate::objects::is_pty_master(f.rdev)
    }) else {
        warn!(
            pid = p.pid,
            pty = index,
            "no slave fd left to make the controlling terminal again"
        );
        return Ok(());
    };
    stub.call(
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
    if fg_pgrp != 0 {
        let pg = ids.inner(fg_pgrp);
        let addr = stub.put(&pg.to_le_bytes())?;
        if let Err(e) = stub.call(
            "ioctl(TIOCSPGRP)",
            libc::SYS_ioctl,
            [slave.fd as u64, libc::TIOCSPGRP, addr, 0, 0, 0],
        ) {
            warn!(pid = p.pid, pgrp = pg, error = %cr_sys::error::one_line(&e), "foreground group of the terminal not restored");
        }
    }
    Ok(())
}

/// /dev/tty (5:0): the caller's controlling terminal.
fn is_dev_tty(rdev: u64) -> bool {
    cr_sys::proc::is_dev(rdev, 5, 0)
}

/// The /dev/tty fds, opened again now that the process's session has its
/// controlling terminal back.
pub fn reopen_dev_tty(
    stub: &mut Stub<'_>,
    pid: u32,
    fds: &[proto::Fd],
) -> Result<(), RestoreError> {
    for f in fds
        .iter()
        .filter(|f| f.shared_pid == 0 && f.kind == FdKind::CharDevice as i32 && is_dev_tty(f.rdev))
    {
        let flags = (f.flags as i32) & !OPEN_ONLY;
        let cloexec = (flags & libc::O_CLOEXEC) as u64;
        reopen(stub, f, FdKind::CharDevice, flags | libc::O_NOCTTY, cloexec)?;
        for d in fds.iter().filter(|d| {
            d.shared_pid == pid && d.shared_fd == f.fd && deferred_tty(fds, d.shared_fd)
        }) {
            let cloexec = ((d.flags as i32) & libc::O_CLOEXEC) as u64;
            stub.call(
                "dup3",
                libc::SYS_dup3,
                [f.fd as u64, d.fd as u64, cloexec, 0, 0, 0],
            )
            .step(|| format!("cannot share /dev/tty as fd {}", d.fd))?;
        }
    }
    Ok(())
}

/// Fd `fd` of this process is a /dev/tty opened again only at the end.
fn deferred_tty(fds: &[proto::Fd], fd: i32) -> bool {
    fds.iter().any(|f| {
        f.fd == fd && f.shared_pid == 0 && f.kind == FdKind::CharDevice as i32 && is_dev_tty(f.rdev)
    })
}
