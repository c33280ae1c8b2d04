//! fanotify groups: fanotify_init's flags and event flags, and the marks
//! as fdinfo lists them — on a file or directory (found from its file
//! handle, opened on its filesystem's mount: open_by_handle_at, which
//! needs CAP_DAC_READ_SEARCH), on a mount (by its id in mountinfo) or on
//! a whole filesystem (a mount point of its device) — each saved with the
//! path it is on. The restore makes the group again and marks those
//! paths.
//!
//! Refused by name: a mark on a file removed since (no path to mark), a
//! mark of a kind this build does not know (a newer kernel's), a mark
//! asking for permission events (every open of a marked file, the
//! checkpoint's and the restore's own included, would wait for an answer
//! from a program that is stopped). In a dump whose processes end, events
//! queued and still not read after the program was given a short while to
//! read them are dropped with a warning, as inotify's are (see
//! [`super::refuse_queued`]): the kernel has no way to queue them again,
//! only notifications can be queued (permission marks are refused), and a
//! group marking a whole mount also gets the checkpoint's own opens.

use crate::error::{RestoreError, StepContext};
use crate::kinds::fds::{FdScan, OpenFd};
use cr_image::model::fds::{FanotifyMark, FanotifyMarkOn};
use cr_image::model::{Fd, FdKind};
use cr_sys::fdio;
use cr_sys::proc::FanotifyObject;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;

/// FAN_OPEN_PERM, FAN_ACCESS_PERM, FAN_OPEN_EXEC_PERM and FAN_PRE_ACCESS
/// (Linux 6.14; libc does not name it yet).
const PERMISSION_EVENTS: u64 =
    libc::FAN_OPEN_PERM | libc::FAN_ACCESS_PERM | libc::FAN_OPEN_EXEC_PERM | 0x0010_0000;

/// The group open as fd `f`, from its fdinfo.
pub fn describe(cx: &FdScan<'_>, f: &OpenFd<'_>) -> Result<FdKind, String> {
    let g = f
        .info
        .fanotify()
        .ok_or("a fanotify group whose fdinfo cannot be read")?;
    super::refuse_queued(cx, f, "a fanotify group", false)?;
    let marks = g
        .marks
        .iter()
        .map(|m| {
            let asks = m.mask as u64 & PERMISSION_EVENTS;
            if asks != 0 {
                return Err(format!(
                    "a fanotify mark asking for permission events ({asks:#x}; not supported: every open of a marked file, the checkpoint's and the restore's own, would wait for the stopped program's answer)"
                ));
            }
            let (on, path) = match &m.on {
                FanotifyObject::Inode(h) => (FanotifyMarkOn::Inode, inode_path(h)?),
                FanotifyObject::Mount { mnt_id } => (
                    FanotifyMarkOn::Mount,
                    cr_sys::proc::mount_point_by_id(*mnt_id)
                        .ok_or_else(|| {
                            format!("a fanotify mark on mount {mnt_id}, which has no mount point here")
                        })?
                        .to_string_lossy()
                        .into_owned(),
                ),
                FanotifyObject::Filesystem { sdev } => {
                    let (maj, min) = ((*sdev >> 20) as u32, (*sdev & 0xfffff) as u32);
                    let p = cr_sys::proc::mount_point(maj, min).ok_or_else(|| {
                        format!(
                            "a fanotify mark on the filesystem of device {maj}:{min}, which has no mount here"
                        )
                    })?;
                    (FanotifyMarkOn::Filesystem, p.to_string_lossy().into_owned())
                }
                FanotifyObject::Other(line) => {
                    return Err(format!(
                        "a fanotify mark of a kind this build does not know (\"fanotify {line}\")"
                    ))
                }
            };
            Ok(FanotifyMark {
                on,
                path,
                mflags: m.mflags,
                mask: m.mask,
                ignored_mask: m.ignored_mask,
            })
        })
        .collect::<Result<_, String>>()?;
    Ok(FdKind::Fanotify {
        flags: g.flags,
        event_flags: g.event_flags,
        marks,
    })
}

/// The path of the file an inode mark is on (it must still have one).
fn inode_path(h: &cr_sys::proc::WatchedHandle) -> Result<String, String> {
    let (file, path) = super::watched_file(h, "a fanotify mark")?;
    let open = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&file));
    let md = std::fs::metadata(&open).map_err(|e| format!("a fanotify mark on {path}: {e}"))?;
    if md.nlink() == 0 {
        return Err(format!(
            "a fanotify mark on the removed file {path} (not supported: it has no path to mark again)"
        ));
    }
    Ok(path)
}

/// The group of fd `f` made again, with its marks.
pub fn group(
    f: &Fd,
    flags: u32,
    event_flags: u32,
    marks: &[FanotifyMark],
) -> Result<OwnedFd, RestoreError> {
    let fd = fdio::fanotify_init(flags, event_flags)
        .step(|| format!("cannot create fanotify group {}", f.fd))?;
    for m in marks {
        let what = || format!("cannot mark {} again (fanotify fd {})", m.path, f.fd);
        let place = match m.on {
            // The very file the handle led to, even a symbolic link.
            FanotifyMarkOn::Inode => libc::FAN_MARK_DONT_FOLLOW,
            FanotifyMarkOn::Mount => libc::FAN_MARK_MOUNT,
            FanotifyMarkOn::Filesystem => libc::FAN_MARK_FILESYSTEM,
        };
        let add = libc::FAN_MARK_ADD | place | (m.mflags & libc::FAN_MARK_EVICTABLE);
        // The ignore mask first: a mark made with FAN_MARK_IGNORE must be
        // created by it (the kernel refuses to add it to a mark made
        // without).
        if m.ignored_mask != 0 {
            let how = if m.mflags & libc::FAN_MARK_IGNORE != 0 {
                libc::FAN_MARK_IGNORE
            } else {
                libc::FAN_MARK_IGNORED_MASK
            };
            let surv = m.mflags & libc::FAN_MARK_IGNORED_SURV_MODIFY;
            fdio::fanotify_mark(&fd, add | how | surv, m.ignored_mask as u64, &m.path)
                .step(what)?;
        }
        if m.mask != 0 || m.ignored_mask == 0 {
            fdio::fanotify_mark(&fd, add, m.mask as u64, &m.path).step(what)?;
        }
    }
    Ok(fd)
}
