//! Kind "locks": file locks (flock, POSIX record locks, OFD locks) and
//! file leases (F_SETLEASE), read with the fd that holds them and taken
//! again when the fds of the process are back.
//!
//! They are read from the "lock:" lines of /proc/PID/fdinfo/FD (same format
//! as /proc/locks):
//!
//! ```text
//! lock:   1: FLOCK  ADVISORY  WRITE 5122 fe:00:10010639 0 EOF
//! lock:   1: POSIX  ADVISORY  WRITE 5122 fe:00:10010639 5 14
//! lock:   1: OFDLCK ADVISORY  READ -1 fe:00:10010639 50 59
//! lock:   1: LEASE  ACTIVE    WRITE 5122 fe:00:10010639 0 EOF
//! ```
//!
//! A lease belongs to its open file description and is taken again with
//! the same fcntl. The kernel grants a write lease only when no other open
//! file description of the file exists, and a read lease only on a
//! description opened read-only, with no writer: both held when the
//! original took it, and the restore opens nothing else of the file.
//!
//! A lease being broken (another process opened the file in a way that
//! conflicts with it; the holder was sent its I/O signal and must give it
//! up by the break time, /proc/sys/fs/lease-break-time):
//!
//! ```text
//! lock:   1: LEASE  BREAKING  UNLCK 5122 fe:00:10010639 0 EOF
//! ```
//!
//! The line (like F_GETLEASE) gives the type it is broken to, READ (a
//! write lease, a reader opened) or UNLCK; the type it was taken with is
//! WRITE for READ, and for UNLCK on a description opened for writing (no
//! read lease is granted there). On a read-only description both are
//! possible: a read-only open of the file (O_NONBLOCK, from outside) tells
//! them apart, refused (EWOULDBLOCK) only by a write lease, and changes
//! nothing of a lease being broken. The restore takes the lease with its
//! type and breaks it again the same way, an open that does not wait
//! (O_NONBLOCK, by the restorer), the I/O signal owner cleared meanwhile:
//! the process got the signal when the break began, not a second one (the
//! owner is given back after, see `fds::take_signal_owners`). Its break
//! time starts again at the restore.
//!
//! A process blocked opening the file waits on the lease ("->" BREAKER
//! lines of /proc/locks, whose entry is the lease's, or another lease's of
//! the same file). One of the tree stops waiting when it is frozen and
//! opens again (the restarted call) after the restore; one outside the
//! tree would open the file as soon as the original holder is gone and
//! not wait for the restored lease: refused.
//!
//! The kernel lists a lock on the fd whose open file description took it
//! (flock, OFD) or through which the process took it (POSIX). Lines
//! starting with "->" are waiters, not holders: a process blocked in
//! F_SETLKW or flock() asks again when its syscall restarts.

#[cfg(test)]
mod tests;

use crate::error::{RestoreError, StepContext};
use crate::kinds::fds::{OpenFd, TreeFds};
use crate::stub::Stub;
use cr_image::model::{Fd, FileLock, LeaseBreak, LockKind};
use cr_sys::error::{Errno, SysError};
use std::os::unix::fs::OpenOptionsExt;

/// The locks held through fd `f` of a process of `tree`.
pub fn of_fd(f: &OpenFd<'_>, tree: &TreeFds) -> Result<Vec<FileLock>, String> {
    let mut out = Vec::new();
    for line in f.info.all("lock") {
        let Some(mut l) = parse(line)? else {
            continue;
        };
        if let Some(to) = l.breaking {
            no_outside_waiter(line, tree)?;
            match taken_as(f, to)? {
                Some(write) => l.write = write,
                None => continue, // its break time ran out meanwhile
            }
        }
        out.push(l);
    }
    Ok(out)
}

/// The type a lease being broken to `to` was taken with (write: true), or
/// None when it is gone (its break time ran out: the kernel removes it
/// when the file is next opened, by our look).
fn taken_as(f: &OpenFd<'_>, to: LeaseBreak) -> Result<Option<bool>, String> {
    if to == LeaseBreak::ToRead || f.info.flags as i32 & libc::O_ACCMODE != libc::O_RDONLY {
        return Ok(Some(true));
    }
    let path = format!("/proc/{}/fd/{}", f.pid, f.fd);
    let look = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(&path);
    match look {
        Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => Ok(Some(true)),
        Err(e) => Err(format!(
            "holding a file lease being broken whose type cannot be told (a read-only open of {path} to see: {e})"
        )),
        Ok(_) => {
            // Granted: no write lease. Still ours, or timed out meanwhile.
            let now = cr_sys::proc::fdinfo(f.pid, f.fd)
                .map_err(|e| format!("gone while its lease was looked at ({e})"))?;
            let leased = now
                .all("lock")
                .any(|l| l.split_whitespace().nth(1) == Some("LEASE"));
            Ok(leased.then_some(false))
        }
    }
}

/// Refuse a lease being broken (fdinfo line `line`) that a process outside
/// `tree` waits for, blocked opening the file.
fn no_outside_waiter(line: &str, tree: &TreeFds) -> Result<(), String> {
    let file = line.split_whitespace().nth(5).unwrap_or_default();
    let all = std::fs::read_to_string("/proc/locks")
        .map_err(|e| format!("holding a file lease being broken (cannot read /proc/locks: {e})"))?;
    match lease_waiters(&all, file)
        .into_iter()
        .find(|p| !tree.in_tree(*p))
    {
        Some(pid) => Err(format!(
            "holding a file lease that process {pid}, outside the tree, waits for (blocked opening the file until the lease is given up: it would open it once this holder is gone, not wait for the restored one; not supported)"
        )),
        None => Ok(()),
    }
}

/// The processes /proc/locks (`all`) shows waiting for a lease of file
/// `file` (its "dev:inode"): "->" BREAKER lines under a lease entry of the
/// file.
fn lease_waiters(all: &str, file: &str) -> Vec<i32> {
    let mut entries = std::collections::HashSet::new();
    let mut pids = Vec::new();
    for l in all.lines() {
        let w: Vec<&str> = l.split_whitespace().collect();
        match w.as_slice() {
            [id, "LEASE", _, _, _, f, ..] if *f == file => {
                entries.insert(*id);
            }
            [id, "->", "LEASE", "BREAKER", _, pid, ..] if entries.contains(id) => {
                pids.extend(pid.parse::<i32>().ok());
            }
            _ => {}
        }
    }
    pids
}

fn parse(line: &str) -> Result<Option<FileLock>, String> {
    let w: Vec<&str> = line.split_whitespace().collect();
    // "1:" "FLOCK" "ADVISORY" "WRITE" pid dev:ino start end
    if w.len() < 8 || w[1] == "->" || w[0] == "->" {
        return Ok(None);
    }
    let kind = match w[1] {
        "FLOCK" => LockKind::Flock,
        "POSIX" => LockKind::Posix,
        "OFDLCK" => LockKind::Ofd,
        "LEASE" if w[2] == "ACTIVE" => LockKind::Lease,
        "LEASE" if w[2] == "BREAKING" => {
            let breaking = match w[3] {
                "READ" => LeaseBreak::ToRead,
                "UNLCK" => LeaseBreak::ToUnlock,
                other => {
                    return Err(format!(
                        "holding a file lease being broken to {other} (not supported)"
                    ))
                }
            };
            // The type it was taken with: see `taken_as`.
            return Ok(Some(FileLock {
                kind: LockKind::Lease,
                write: breaking == LeaseBreak::ToRead,
                start: 0,
                len: 0,
                breaking: Some(breaking),
            }));
        }
        "LEASE" => {
            return Err(format!(
                "holding a file lease in state {} (not supported)",
                w[2]
            ))
        }
        "DELEG" => return Err("holding an NFS delegation (not supported)".into()),
        other => return Err(format!("holding a lock of kind {other} (not supported)")),
    };
    if w[2] == "MANDATORY" && kind != LockKind::Lease {
        return Err("holding a mandatory lock (not supported)".into());
    }
    let write = match w[3] {
        "READ" => false,
        "WRITE" => true,
        other => return Err(format!("holding a lock of mode {other} (not supported)")),
    };
    let start: u64 = w[6]
        .parse()
        .map_err(|_| format!("an unreadable lock line {line:?}"))?;
    let len = match w[7] {
        "EOF" => 0,
        end => {
            end.parse::<u64>()
                .map_err(|_| format!("an unreadable lock line {line:?}"))?
                .saturating_sub(start)
                + 1
        }
    };
    Ok(Some(FileLock {
        kind,
        write,
        start,
        len,
        breaking: None,
    }))
}

/// Take the locks fd `f` held again. flock and OFD locks belong to the
/// open file description (taken once, by its first holder); POSIX locks to
/// the process.
pub fn take(stub: &mut Stub<'_>, f: &Fd) -> Result<(), RestoreError> {
    for l in &f.locks {
        let what = || {
            format!(
                "cannot take the {} lock on {} (fd {}) again: is it held by another process?",
                l.kind.name(),
                f.path,
                f.fd
            )
        };
        let lock_type = if l.write {
            libc::F_WRLCK
        } else {
            libc::F_RDLCK
        };
        match l.kind {
            LockKind::Flock if f.shared.is_none() => {
                let op = if l.write {
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
            LockKind::Flock => {}
            // Of the open file description: taken by its first holder.
            LockKind::Lease if f.shared.is_none() => {
                stub.call(
                    "fcntl(F_SETLEASE)",
                    libc::SYS_fcntl,
                    [
                        f.fd as u64,
                        libc::F_SETLEASE as u64,
                        lock_type as u64,
                        0,
                        0,
                        0,
                    ],
                )
                .step(what)?;
                if let Some(to) = l.breaking {
                    break_again(stub, f, to)?;
                }
            }
            LockKind::Lease => {}
            LockKind::Ofd if f.shared.is_some() => {}
            LockKind::Posix | LockKind::Ofd => {
                // struct flock: short l_type, short l_whence, off_t l_start,
                // off_t l_len, pid_t l_pid (32 bytes with padding).
                let mut fl = vec![0u8; 32];
                fl[0..2].copy_from_slice(&(lock_type as i16).to_le_bytes());
                fl[2..4].copy_from_slice(&(libc::SEEK_SET as i16).to_le_bytes());
                fl[8..16].copy_from_slice(&l.start.to_le_bytes());
                fl[16..24].copy_from_slice(&l.len.to_le_bytes());
                let addr = stub.put(&fl)?;
                let cmd = if l.kind == LockKind::Posix {
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
        }
    }
    Ok(())
}

/// Break the lease fd `f` holds again towards `to`, as an opener that does
/// not wait does: an open of the file (O_NONBLOCK, by the restorer) that
/// conflicts with the lease, refused with EWOULDBLOCK. The fd's I/O signal
/// owner (F_SETLEASE made it the process) is cleared first, so that the
/// break signals no one; `fds::take_signal_owners` gives the image's back.
fn break_again(stub: &mut Stub<'_>, f: &Fd, to: LeaseBreak) -> Result<(), RestoreError> {
    let what = || format!("cannot break the lease on {} (fd {}) again", f.path, f.fd);
    stub.call(
        "fcntl(F_SETOWN)",
        libc::SYS_fcntl,
        [f.fd as u64, libc::F_SETOWN as u64, 0, 0, 0, 0],
    )
    .step(what)?;
    stub.flush().step(what)?;
    let path = format!("/proc/{}/fd/{}", stub.pid(), f.fd);
    let mut open = std::fs::OpenOptions::new();
    match to {
        LeaseBreak::ToRead => open.read(true),
        LeaseBreak::ToUnlock => open.write(true),
    };
    let opened = open
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(&path);
    let source = match opened {
        Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => return Ok(()),
        Err(e) => SysError::Io { path, source: e },
        // Closed at once: nothing of the file changed.
        Ok(_) => SysError::Syscall {
            what: format!("a conflicting open of {path} (granted: it broke no lease)"),
            source: Errno(libc::EEXIST),
        },
    };
    Err(RestoreError::Step {
        what: what(),
        source,
    })
}
