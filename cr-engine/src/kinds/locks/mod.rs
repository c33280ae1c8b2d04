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
//! original took it, and the restore opens nothing else of the file. A
//! lease being broken (an opener waits for its holder to give it up:
//! BREAKING) is refused: the opener is outside the image and would not
//! wait for the restored holder.
//!
//! The kernel lists a lock on the fd whose open file description took it
//! (flock, OFD) or through which the process took it (POSIX). Lines
//! starting with "->" are waiters, not holders: a process blocked in
//! F_SETLKW or flock() asks again when its syscall restarts.

#[cfg(test)]
mod tests;

use crate::error::{RestoreError, StepContext};
use crate::kinds::fds::OpenFd;
use crate::stub::Stub;
use cr_image::model::{Fd, FileLock, LockKind};

/// The locks held through fd `f`.
pub fn of_fd(f: &OpenFd<'_>) -> Result<Vec<FileLock>, String> {
    f.info
        .all("lock")
        .filter_map(|v| parse(v).transpose())
        .collect()
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
        "LEASE" => {
            return Err(format!(
                "holding a file lease that is being broken ({}: another process is opening the file and waits for it; not supported)",
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
