//! File descriptors of a restored process: each file reopened inside the
//! process at its number, with its flags and offset.

use crate::error::{RestoreError, StepContext};
use crate::restore::Stub;
use cr_image::proto;
use tracing::warn;

/// Open flags that must not be replayed (they act only at open time).
const OPEN_ONLY: i32 = libc::O_CREAT | libc::O_EXCL | libc::O_TRUNC | libc::O_NOCTTY;

pub fn restore(stub: &mut Stub<'_>, fds: &[proto::Fd]) -> Result<(), RestoreError> {
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
        let got = stub
            .open(&f.path, flags)
            .step(|| format!("cannot reopen {} as fd {}", f.path, f.fd))?;
        if got != f.fd as u64 {
            let cloexec = flags & libc::O_CLOEXEC;
            stub.call(
                "dup3",
                libc::SYS_dup3,
                [got, f.fd as u64, cloexec as u64, 0, 0, 0],
            )
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
