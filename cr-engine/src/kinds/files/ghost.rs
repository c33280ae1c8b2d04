//! Ghost files: a directory, a FIFO, a device node or a symbolic link (an
//! O_PATH fd of it) removed while a process still used it (its working
//! directory, an open fd), which /proc shows as "PATH (deleted)". The
//! restore makes it again at PATH (with any missing parent directories),
//! opens it in the restorer, and removes what it made: the processes then
//! hold a removed file of the same path and type, as before. One per path, shared by every process that used it
//! (a fork's children share their parent's working directory).
//!
//! A path taken since by another file cannot be used: refused by name
//! (the name of a removed file is the one it had when it was removed).
//!
//! The directory /proc/PID of a process that has exited (a working
//! directory or fd kept in it after the process was reaped) cannot be
//! made with mkdir: a child of the restorer with that PID (clone3
//! `set_tid`) holds it while the processes take it (their working
//! directories and fds: /proc refuses a dead process's directory), and is
//! killed and reaped once every process is rebuilt ([`dead_proc_dir`],
//! [`end_holders`]); they then hold a /proc/PID that is gone, as before.
//! Files under such a directory (an fd of /proc/PID/mountinfo kept after
//! the process was reaped) are opened through the same holder
//! ([`dead_proc_entry`]).

use crate::error::{RestoreError, StepContext};
use crate::restore::Restorer;
use cr_sys::clone::Doomed;
use cr_sys::fdio;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::Path;

/// The restorer's ghosts by the path /proc showed.
#[derive(Default)]
struct Ghosts(HashMap<String, OwnedFd>);

const SUFFIX: &str = " (deleted)";

/// The path of a removed file as /proc shows it (`shown`), if it is one:
/// it ends with " (deleted)" and no file has that whole name.
pub fn removed(shown: &str) -> Option<&str> {
    let p = shown.strip_suffix(SUFFIX)?;
    (std::fs::symlink_metadata(shown).is_err() && p.starts_with('/')).then_some(p)
}

/// The restorer's fd of the removed directory shown as `shown`, made again.
pub fn dir(r: &mut Restorer<'_>, shown: &str) -> Result<RawFd, RestoreError> {
    if let Some(pid) = proc_pid_dir(shown) {
        return dead_proc_dir(r, shown, pid);
    }
    make(r, shown, |p| {
        std::fs::create_dir(p).map_err(|e| io(e, "mkdir", p))?;
        fdio::open(p, libc::O_RDONLY | libc::O_DIRECTORY)
    })
}

/// The PID of a removed directory shown as "/proc/PID (deleted)".
fn proc_pid_dir(shown: &str) -> Option<i32> {
    pid_named(shown.strip_suffix(SUFFIX)?.strip_prefix("/proc/")?)
}

/// The PID a /proc entry's name `n` is, if it is one.
fn pid_named(n: &str) -> Option<i32> {
    (!n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        .then(|| n.parse().ok())
        .flatten()
}

/// A file or directory inside /proc/PID of a process that has exited
/// (`shown` as "/proc/PID/status": /proc names such an fd without
/// " (deleted)"), and no process has that PID now: the restorer's fd of
/// /proc/PID held again ([`dead_proc_dir`]) and the path under it. None
/// for any other path, or while a process has the PID (a process of the
/// tree, already made again).
pub fn dead_proc_entry(
    r: &mut Restorer<'_>,
    shown: &str,
) -> Result<Option<(RawFd, String)>, RestoreError> {
    let name = shown.strip_suffix(SUFFIX).unwrap_or(shown);
    let Some((n, rest)) = name.strip_prefix("/proc/").and_then(|p| p.split_once('/')) else {
        return Ok(None);
    };
    let Some(pid) = pid_named(n) else {
        return Ok(None);
    };
    if rest.is_empty() || Path::new(&format!("/proc/{pid}")).exists() {
        return Ok(None);
    }
    let dir = dead_proc_dir(r, &format!("/proc/{pid}{SUFFIX}"), pid)?;
    Ok(Some((dir, rest.to_string())))
}

/// The restorer's fd of /proc/`pid` of a process that has exited (see the
/// module's documentation); the PID must be free.
fn dead_proc_dir(r: &mut Restorer<'_>, shown: &str, pid: i32) -> Result<RawFd, RestoreError> {
    if let Some(fd) = r.stash.get::<Ghosts>().0.get(shown) {
        return Ok(fd.as_raw_fd());
    }
    let holder = Doomed::spawn_as(pid)?;
    let fd = fdio::open(&format!("/proc/{pid}"), libc::O_RDONLY | libc::O_DIRECTORY)
        .step(|| format!("cannot open /proc/{pid} of a process that has exited again"))?;
    r.stash.get::<Holders>().0.push(holder);
    let raw = fd.as_raw_fd();
    r.stash.get::<Ghosts>().0.insert(shown.to_string(), fd);
    Ok(raw)
}

/// The children that hold /proc/PID directories of processes that had
/// exited ([`dead_proc_dir`]).
#[derive(Default)]
struct Holders(Vec<Doomed>);

/// Kill and reap the holders of /proc/PID directories, once every
/// process took what it holds there (before `--verify` looks).
pub fn end_holders(r: &mut Restorer<'_>) {
    for h in r.stash.get::<Holders>().0.drain(..) {
        h.end();
    }
}

/// The restorer's fd (read and write, non-blocking: it never waits for a
/// peer) of the removed FIFO shown as `shown`, made again as `node`
/// (permission bits and owner; None: an older image, 0600 and ours).
pub fn fifo(r: &mut Restorer<'_>, shown: &str, node: Option<Node>) -> Result<RawFd, RestoreError> {
    make(r, shown, |p| {
        fdio::mkfifo(p, 0o600)?;
        // Opened before its mode is set: a FIFO of mode 0 opens for root
        // only, and the restorer may run without CAP_DAC_OVERRIDE.
        let fd = fdio::open(p, libc::O_RDWR | libc::O_NONBLOCK)?;
        if let Some(node) = node {
            set_owner_and_mode(p, node)?;
        }
        Ok(fd)
    })
}

/// A device node or FIFO as it was: `mode` its type (S_IFCHR, S_IFBLK or S_IFIFO) and
/// permission bits, `rdev` its device number, `owner` its uid and gid.
#[derive(Debug, Clone, Copy)]
pub struct Node {
    pub mode: u32,
    pub rdev: u64,
    pub owner: (u32, u32),
}

/// The restorer's O_PATH fd of the removed device node shown as `shown`,
/// made again as `node` (owner included: chown before it is removed
/// again; then its permission bits once more, which chown may clear).
/// Each fd of it is a description opened anew through /proc/self/fd
/// (which reopens the removed node).
pub fn device(r: &mut Restorer<'_>, shown: &str, node: Node) -> Result<RawFd, RestoreError> {
    make(r, shown, |p| {
        fdio::mknod(p, node.mode, node.rdev)?;
        set_owner_and_mode(p, node)?;
        fdio::open(p, libc::O_PATH)
    })
}

/// The restorer's O_PATH fd of the removed symbolic link shown as `shown`,
/// made again pointing at `target`, owned by `owner`.
pub fn symlink(
    r: &mut Restorer<'_>,
    shown: &str,
    target: &[u8],
    owner: (u32, u32),
) -> Result<RawFd, RestoreError> {
    use std::os::unix::ffi::OsStrExt;
    make(r, shown, |p| {
        std::os::unix::fs::symlink(std::ffi::OsStr::from_bytes(target), p)
            .map_err(|e| io(e, "symlink", p))?;
        std::os::unix::fs::lchown(p, Some(owner.0), Some(owner.1))
            .map_err(|e| io(e, &format!("chown {}:{}", owner.0, owner.1), p))?;
        fdio::open(p, libc::O_PATH | libc::O_NOFOLLOW)
    })
}

/// Chown `p` to `node`'s owner, then give it `node`'s permission bits
/// (again: chown may clear set-user-ID and set-group-ID).
pub(crate) fn set_owner_and_mode(p: &str, node: Node) -> cr_sys::error::Result<()> {
    let (uid, gid) = node.owner;
    std::os::unix::fs::lchown(p, Some(uid), Some(gid))
        .map_err(|e| io(e, &format!("chown {uid}:{gid}"), p))?;
    fdio::chmod(p, node.mode)
}

fn io(e: std::io::Error, what: &str, p: &str) -> cr_sys::SysError {
    cr_sys::SysError::Syscall {
        what: format!("{what} {p}"),
        source: cr_sys::Errno(e.raw_os_error().unwrap_or(libc::EIO)),
    }
}

/// Make the ghost `shown` with `create` at its path (parents first), keep
/// its fd, remove what was made.
fn make(
    r: &mut Restorer<'_>,
    shown: &str,
    create: impl FnOnce(&str) -> cr_sys::error::Result<OwnedFd>,
) -> Result<RawFd, RestoreError> {
    let ghosts = r.stash.get::<Ghosts>();
    if let Some(fd) = ghosts.0.get(shown) {
        return Ok(fd.as_raw_fd());
    }
    let path = shown.strip_suffix(SUFFIX).unwrap_or(shown);
    let what = || format!("cannot make the removed {path} again");
    if std::fs::symlink_metadata(path).is_ok() {
        return Err(RestoreError::Unsupported(format!(
            "the removed {path} cannot be made again: another file has its path now"
        )));
    }
    // Missing parents, deepest first.
    let mut parents = Vec::new();
    let mut up = Path::new(path).parent();
    while let Some(d) = up.filter(|d| std::fs::symlink_metadata(d).is_err()) {
        parents.push(d.to_path_buf());
        up = d.parent();
    }
    for d in parents.iter().rev() {
        std::fs::create_dir(d)
            .map_err(|e| io(e, "mkdir", &d.to_string_lossy()))
            .step(what)?;
    }
    let made = create(path);
    let gone = match &made {
        Ok(fd)
            if std::fs::metadata(format!("/proc/self/fd/{}", fd.as_raw_fd()))
                .is_ok_and(|m| m.is_dir()) =>
        {
            std::fs::remove_dir(path)
        }
        Ok(_) => std::fs::remove_file(path),
        Err(_) => Ok(()),
    };
    for d in &parents {
        let _ = std::fs::remove_dir(d);
    }
    let fd = made.step(what)?;
    gone.map_err(|e| io(e, "remove", path)).step(what)?;
    let raw = fd.as_raw_fd();
    r.stash.get::<Ghosts>().0.insert(shown.to_string(), fd);
    Ok(raw)
}
