//! Kind "external": fds that lead outside the tree — a pipe or a unix
//! socket shared with a process that is not checkpointed, a terminal the
//! job was started from. Their other end is not ours to save, so they are
//! recorded as external (`FdKind::Inherited`: what they led to, and a
//! terminal's settings) and bound at restore to what the user names:
//!
//! - `cr_restart --inherit-fd FD=TARGET`, FD being `N`, `PID:N` or the key
//!   an error names (the fd's /proc link: `pipe:[1234]`), TARGET a path or
//!   `fd:M` (cr_restart's own fd M), as CRIU's `--inherit-fd` does;
//! - unbound fds 0, 1 and 2: cr_restart's own; an unbound terminal at any
//!   fd: cr_restart's terminal (which gets the saved settings with
//!   `--shell-job`);
//! - any other unbound one: /dev/null with `--external-to-null`, else the
//!   restore is refused before anything is created, naming the fd and what
//!   it led to.
//!
//! The pipes, unix and tty kinds find these fds; [`record`] records them.

#[cfg(test)]
mod tests;

use crate::error::{RestoreError, StepContext};
use crate::kinds::fds::OpenFd;
use crate::kinds::{Described, FileKind, Opened};
use crate::options::{Binding, ExternalFd, InheritFd};
use crate::restore::{Rebuild, Restorer};
use cr_image::model::{Checkpoint, Fd, FdKind, Process};
use cr_sys::fdio;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileTypeExt;
use tracing::warn;

pub struct External;

/// Record fd `f`, which leads outside the tree to `outside` (said for
/// people: "a pipe shared with process 12 outside the tree").
pub fn record(f: &OpenFd<'_>, outside: String) -> Described {
    let stolen = fdio::steal_fd(f.pid, f.fd).ok();
    let tty = stolen.as_ref().is_some_and(|s| fdio::is_tty(s.as_fd()));
    let (termios, winsize) = match (tty, &stolen) {
        (true, Some(s)) => (
            fdio::tcgets(s).unwrap_or_default(),
            fdio::get_winsize(s).unwrap_or_default(),
        ),
        _ => (Vec::new(), Vec::new()),
    };
    Ok(Some(FdKind::Inherited {
        termios,
        winsize,
        outside,
    }))
}

/// The `--inherit-fd` binding fd `f` of process `pid` (the last one given
/// wins, as options usually do).
fn binding<'a>(opts: &'a [InheritFd], pid: u32, f: &Fd) -> Option<&'a InheritFd> {
    opts.iter().rev().find(|b| b.binds(pid, f.fd, &f.path))
}

/// Every external fd of the image and what it led to.
fn externals(ck: &Checkpoint) -> impl Iterator<Item = (&Process, &Fd, &str)> {
    ck.processes.iter().flat_map(|p| {
        p.fds.iter().filter_map(move |f| match &f.kind {
            FdKind::Inherited { outside, .. } => Some((p, f, outside.as_str())),
            _ => None,
        })
    })
}

impl FileKind for External {
    fn name(&self) -> &'static str {
        "external"
    }

    /// The other kinds decide what leads outside (see [`record`]).
    fn describe(
        &self,
        _cx: &mut crate::kinds::fds::FdScan<'_>,
        _f: &OpenFd<'_>,
    ) -> Option<Described> {
        None
    }

    /// Before anything is created: every external fd has a binding, every
    /// binding binds something, and every `fd:M` names an open fd of ours.
    fn prepare(&self, r: &mut Restorer<'_>, ck: &Checkpoint) -> Result<(), RestoreError> {
        let opts = &r.opts.inherit_fd;
        for b in opts {
            if !externals(ck).any(|(p, f, _)| b.binds(p.pid, f.fd, &f.path)) {
                let what = match &b.which {
                    ExternalFd::Number(n) => {
                        format!("no process of the image had fd {n} leading outside the tree")
                    }
                    ExternalFd::OfProcess(p, n) => {
                        format!("fd {n} of process {p} did not lead outside the tree")
                    }
                    ExternalFd::Key(k) => format!("no fd of the image led to {k}"),
                };
                return Err(RestoreError::Unbound(format!("--inherit-fd {b}: {what}")));
            }
            if let Binding::OwnFd(m) = b.to {
                fdio::dup_own(m).step(|| format!("--inherit-fd {b}: fd {m} is not open here"))?;
            }
        }
        for (p, f, outside) in externals(ck) {
            let tty = matches!(&f.kind, FdKind::Inherited { termios, .. } if !termios.is_empty());
            if f.fd > 2 && !tty && !r.opts.external_to_null && binding(opts, p.pid, f).is_none() {
                let outside = if outside.is_empty() {
                    "something outside the tree"
                } else {
                    outside
                };
                return Err(RestoreError::Unbound(format!(
                    "fd {} of process {} led to {outside} ({}); give it with --inherit-fd {}=PATH or {}=fd:M, or use --external-to-null",
                    f.fd, p.pid, f.path, f.fd, f.fd
                )));
            }
        }
        Ok(())
    }

    fn open(
        &self,
        cx: &mut Rebuild<'_, '_, '_>,
        p: &Process,
        f: &Fd,
    ) -> Option<Result<Opened, RestoreError>> {
        let FdKind::Inherited { termios, .. } = &f.kind else {
            return None;
        };
        let opts = cx.r.opts;
        Some(
            match binding(&opts.inherit_fd, p.pid, f) {
                Some(b) => bound(b, f),
                None if f.fd <= 2 || !termios.is_empty() => ours(f, termios, opts.shell_job),
                None => null(f),
            }
            .map(Opened::Ours),
        )
    }
}

/// Open what `b` binds fd `f` to.
fn bound(b: &InheritFd, f: &Fd) -> Result<OwnedFd, RestoreError> {
    let what = || format!("--inherit-fd {b}");
    match &b.to {
        Binding::OwnFd(m) => fdio::dup_own(*m).step(what),
        Binding::Path(path) => {
            let text = path.to_string_lossy();
            if std::fs::metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
                // A unix socket: connected to, with the type it accepts.
                let name = path.as_os_str().as_encoded_bytes();
                let mut last = None;
                for ty in [libc::SOCK_STREAM, libc::SOCK_SEQPACKET, libc::SOCK_DGRAM] {
                    let s = fdio::unix_socket(ty).step(what)?;
                    match fdio::connect_unix(&s, name) {
                        Ok(()) => return Ok(s),
                        Err(e) => last = Some(e),
                    }
                }
                return Err(last.expect("tried a type")).step(what);
            }
            let accmode = f.flags as i32 & libc::O_ACCMODE;
            let mut flags = accmode | (f.flags as i32 & libc::O_APPEND);
            if accmode != libc::O_RDONLY {
                flags |= libc::O_CREAT;
            }
            fdio::open(&text, flags).step(what)
        }
    }
}

/// /dev/null with the fd's access mode.
fn null(f: &Fd) -> Result<OwnedFd, RestoreError> {
    let accmode = f.flags as i32 & libc::O_ACCMODE;
    fdio::open("/dev/null", accmode).step(|| "cannot open /dev/null".into())
}

/// Unbound fd 0, 1 or 2: ours. A terminal prefers our terminal (the same
/// number first, then any of 0, 1, 2); otherwise, or if we have none, our
/// fd of the same number (a file or pipe we were given); /dev/null if we
/// have nothing there.
fn ours(f: &Fd, termios: &[u8], shell_job: bool) -> Result<OwnedFd, RestoreError> {
    let tty = !termios.is_empty();
    let mut candidates: Vec<(i32, bool)> = Vec::new();
    if tty {
        candidates.extend([(f.fd, true), (0, true), (1, true), (2, true)]);
    }
    candidates.push((f.fd, false));
    for (c, want_tty) in candidates {
        let Ok(dup) = fdio::dup_own(c) else { continue };
        let ours_tty = fdio::is_tty(dup.as_fd());
        if want_tty && !ours_tty {
            continue;
        }
        if ours_tty && tty && shell_job {
            if let Err(e) = fdio::tcsets(dup.as_fd(), termios) {
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
    null(f)
}
