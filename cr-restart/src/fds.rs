//! File descriptors of a restored process: each file reopened inside the
//! process at its number, with its flags and offset; an open file
//! description shared with an earlier fd (dup, or inherited across fork) is
//! shared again.

use crate::error::{RestoreError, StepContext};
use crate::restore::{Ids, Stub};
use cr_image::proto;
use tracing::warn;

/// Open flags that must not be replayed (they act only at open time).
const OPEN_ONLY: i32 = libc::O_CREAT | libc::O_EXCL | libc::O_TRUNC | libc::O_NOCTTY;

/// Reopen `fds` of image process `pid` inside its stub.
pub fn restore(
    stub: &mut Stub<'_>,
    pid: u32,
    fds: &[proto::Fd],
    ids: &Ids,
) -> Result<(), RestoreError> {
    for f in fds {
        let kind = proto::FdKind::try_from(f.kind).unwrap_or(proto::FdKind::Unspecified);
        if kind == proto::FdKind::Regular {
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
        let flags = (f.flags as i32) & !OPEN_ONLY;
        let cloexec = (flags & libc::O_CLOEXEC) as u64;
        if f.shared_pid != 0 {
            share(stub, pid, f, cloexec, ids)?;
            continue;
        }
        let got = stub
            .open(&f.path, flags)
            .step(|| format!("cannot reopen {} as fd {}", f.path, f.fd))?;
        if got != f.fd as u64 {
            stub.call("dup3", libc::SYS_dup3, [got, f.fd as u64, cloexec, 0, 0, 0])
                .step(|| format!("cannot move {} to fd {}", f.path, f.fd))?;
            stub.call("close", libc::SYS_close, [got, 0, 0, 0, 0, 0])?;
        }
        if kind == proto::FdKind::Regular || (kind == proto::FdKind::Directory && f.pos != 0) {
            stub.call(
                "lseek",
                libc::SYS_lseek,
                [f.fd as u64, f.pos, libc::SEEK_SET as u64, 0, 0, 0],
            )
            .step(|| format!("cannot seek fd {} ({}) to {}", f.fd, f.path, f.pos))?;
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
    if got != f.fd as u64 {
        stub.call("dup3", libc::SYS_dup3, [got, f.fd as u64, cloexec, 0, 0, 0])
            .step(what)?;
        stub.call("close", libc::SYS_close, [got, 0, 0, 0, 0, 0])?;
    }
    Ok(())
}
