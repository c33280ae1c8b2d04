//! Open file descriptors: which kinds can be saved, and their state.
//!
//! Supported now: regular files, directories and the harmless character
//! devices (/dev/null, zero, full, random, urandom). Everything else is
//! refused with the fd and its type named, before anything is frozen.

use crate::CheckpointError;
use cr_image::proto;
use cr_sys::proc;
use std::os::unix::fs::{FileTypeExt, MetadataExt};

/// (major, minor) of the character devices that carry no state.
const SAFE_CHAR_DEVICES: &[(u64, u64, &str)] = &[
    (1, 3, "/dev/null"),
    (1, 5, "/dev/zero"),
    (1, 7, "/dev/full"),
    (1, 8, "/dev/random"),
    (1, 9, "/dev/urandom"),
];

fn major(rdev: u64) -> u64 {
    ((rdev >> 32) & 0xffff_f000) | ((rdev >> 8) & 0xfff)
}

fn minor(rdev: u64) -> u64 {
    ((rdev >> 12) & 0xffff_ff00) | (rdev & 0xff)
}

fn kind_of_link(target: &str) -> &'static str {
    if target.starts_with("pipe:") {
        "pipe"
    } else if target.starts_with("socket:") {
        "socket"
    } else if target.starts_with("anon_inode:") {
        "anonymous inode"
    } else if target.starts_with("/memfd:") {
        "memfd"
    } else {
        "special file"
    }
}

/// Describe every fd of `pid`, or refuse the first one we cannot save.
pub fn collect(pid: i32) -> Result<Vec<proto::Fd>, CheckpointError> {
    let list = proc::list_fds(pid).map_err(|e| CheckpointError::from_sys(pid, e))?;
    let mut out = Vec::with_capacity(list.len());
    for (fd, target) in list {
        let unsupported = |kind: &str| CheckpointError::Unsupported {
            pid,
            what: format!("fd {fd} is a {kind} ({target})"),
        };
        if !target.starts_with('/') || target.starts_with("/memfd:") {
            return Err(unsupported(kind_of_link(&target)));
        }
        if target.ends_with(" (deleted)") {
            return Err(unsupported("file deleted while open"));
        }
        // stat() through the magic link gives the open file itself.
        let md = match std::fs::metadata(format!("/proc/{pid}/fd/{fd}")) {
            Ok(md) => md,
            Err(_) => continue, // closed meanwhile
        };
        let ft = md.file_type();
        let (kind, size, rdev) = if ft.is_file() {
            (proto::FdKind::Regular, md.len(), 0)
        } else if ft.is_dir() {
            (proto::FdKind::Directory, 0, 0)
        } else if ft.is_char_device() {
            let r = md.rdev();
            if !SAFE_CHAR_DEVICES
                .iter()
                .any(|&(ma, mi, _)| ma == major(r) && mi == minor(r))
            {
                let what = if matches!(major(r), 4 | 5 | 136..=143) {
                    "terminal"
                } else {
                    "character device"
                };
                return Err(unsupported(what));
            }
            (proto::FdKind::CharDevice, 0, r)
        } else if ft.is_fifo() {
            return Err(unsupported("fifo"));
        } else if ft.is_socket() {
            return Err(unsupported("socket"));
        } else {
            return Err(unsupported("block device"));
        };
        let info = match proc::read_fdinfo(pid, fd) {
            Ok(i) => i,
            Err(_) => continue,
        };
        out.push(proto::Fd {
            fd,
            kind: kind as i32,
            path: target,
            flags: info.flags,
            pos: info.pos,
            size,
            rdev,
            shared_pid: 0,
            shared_fd: 0,
        });
    }
    Ok(out)
}
