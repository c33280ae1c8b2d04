//! Kind "files": regular files and directories (reopened by path, with
//! their flags and offset), the character devices that carry no state
//! (/dev/null, zero, full, random, urandom) and block devices (reopened by
//! path; a node removed while open is made again with its device number
//! and mode, opened and removed: see [`ghost`]), and files whose content
//! exists nowhere else: memfds (content, seals), files deleted while open
//! and O_TMPFILE files (content saved in the image, restored as an unnamed
//! file in the same directory). Mappings of such files refer to the same
//! content object. O_PATH fds, whatever they lead to (a FIFO, a socket
//! file, a device), are opened again by path with O_PATH; one of a file
//! deleted since is refused (O_PATH cannot be made on an unnamed file).

pub mod ghost;
pub mod relink;
#[cfg(test)]
mod tests;

use crate::capture::Proc;
use crate::error::{CheckpointError, RestoreError, StepContext};
use crate::kinds::fds::{self, FdScan, Objects, OpenFd, OPEN_ONLY};
use crate::kinds::{Described, FileKind, Opened};
use crate::restore::{Rebuild, Restorer};
use cr_image::model::objects::FileContent;
use cr_image::model::{
    Checkpoint, Fd, FdKind, Object, ObjectKind, ObjectTag, PageExtent, PageFile, Process, Vma,
};
use cr_image::{ImageDir, PageReader, PageWriter};
use cr_sys::proc::{dev_major as major, dev_minor as minor, FDTarget};
use cr_sys::{fdio, PAGE_SIZE};
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use tracing::warn;

pub struct Files;

/// (major, minor) of the character devices that carry no state.
const SAFE_CHAR_DEVICES: &[(u64, u64)] = &[(1, 3), (1, 5), (1, 7), (1, 8), (1, 9)];

/// Largest run of file content per extent.
const RUN: u64 = 1 << 20;

impl FileKind for Files {
    fn name(&self) -> &'static str {
        "files"
    }

    fn describe(&self, cx: &mut FdScan<'_>, f: &OpenFd<'_>) -> Option<Described> {
        if !matches!(f.target, FDTarget::Path(_) | FDTarget::MemFD(_)) {
            return None;
        }
        let md = f.md.as_ref()?;
        let ft = md.file_type();
        let content = |memfd: bool, cx: &mut FdScan<'_>| -> Described {
            if let Some(objs) = cx.objects.as_deref_mut() {
                let open = format!("/proc/{}/fd/{}", f.pid, f.fd);
                content_object(objs, &open, md.ino(), &f.link, memfd)?;
            }
            Ok(Some(if memfd {
                FdKind::Memfd { object: md.ino() }
            } else {
                FdKind::DeletedFile { object: md.ino() }
            }))
        };
        if fds::is_path_only(f.info.flags) {
            return Some(if md.nlink() == 0 && ft.is_symlink() {
                removed_symlink(f, md)
            } else if md.nlink() == 0 && !ft.is_dir() {
                Err(format!(
                    "an O_PATH fd of {}, deleted (it has no path to open again)",
                    f.link
                ))
            } else if ft.is_file() {
                regular(cx, f, md)
            } else if ft.is_dir() {
                Ok(Some(FdKind::Directory))
            } else {
                Ok(Some(FdKind::PathOnly))
            });
        }
        Some(if f.link.starts_with("/memfd:") && md.nlink() == 0 {
            content(true, cx)
        } else if ft.is_file() && md.nlink() == 0 {
            content(false, cx)
        } else if ft.is_file() {
            regular(cx, f, md)
        } else if ft.is_dir() {
            Ok(Some(FdKind::Directory))
        } else if ft.is_char_device() {
            let r = md.rdev();
            if SAFE_CHAR_DEVICES.contains(&(major(r), minor(r))) {
                Ok(Some(FdKind::CharDevice {
                    rdev: r,
                    mode: md.mode() & 0o7777,
                    uid: md.uid(),
                    gid: md.gid(),
                }))
            } else {
                Err(format!(
                    "the character device {} ({}:{}, not supported)",
                    f.link,
                    major(r),
                    minor(r)
                ))
            }
        } else if ft.is_socket() {
            Err(format!("a socket bound at {} (not supported)", f.link))
        } else if ft.is_block_device() {
            Ok(Some(FdKind::BlockDevice {
                rdev: md.rdev(),
                mode: md.mode() & 0o7777,
                uid: md.uid(),
                gid: md.gid(),
            }))
        } else {
            Err(format!(
                "{} (a file of unknown type, not supported)",
                f.link
            ))
        })
    }

    fn release(&self, r: &mut Restorer<'_>) -> Result<(), RestoreError> {
        relink::release(r);
        Ok(())
    }

    fn prepare(&self, r: &mut Restorer<'_>, ck: &Checkpoint) -> Result<(), RestoreError> {
        for o in &ck.objects {
            let (c, memfd) = match &o.kind {
                ObjectKind::Memfd(c) => (c, true),
                ObjectKind::DeletedFile(c) => (c, false),
                _ => continue,
            };
            // The other names its mappings show.
            let mut names: Vec<String> = ck
                .processes
                .iter()
                .flat_map(|p| &p.vmas)
                .filter(|v| v.object == Some(o.id) && !memfd)
                .map(|v| {
                    v.path
                        .strip_suffix(" (deleted)")
                        .unwrap_or(&v.path)
                        .to_string()
                })
                .filter(|n| *n != c.name)
                .collect();
            names.sort();
            names.dedup();
            // The access modes of its fds opened with O_NOFOLLOW (shm_open
            // does): a flag only open(2) sets, and not through /proc.
            let nofollow: Vec<i32> = ck
                .processes
                .iter()
                .flat_map(|p| &p.fds)
                .filter(|f| f.kind == FdKind::DeletedFile { object: o.id })
                .filter(|f| f.flags as i32 & libc::O_NOFOLLOW != 0)
                .map(|f| f.flags as i32 & libc::O_ACCMODE)
                .collect();
            let made = file_object(r, c, memfd, &names, &nofollow)?;
            let held = r.stash.get::<Held>();
            held.files.insert((o.kind.tag(), o.id), made.fd);
            for (name, fd) in made.aliases {
                held.aliases.insert((o.id, name), fd);
            }
            if !made.nofollow.is_empty() {
                held.nofollow.insert(o.id, made.nofollow);
            }
        }
        Ok(())
    }

    fn open(
        &self,
        cx: &mut Rebuild<'_, '_, '_>,
        _p: &Process,
        f: &Fd,
    ) -> Option<Result<Opened, RestoreError>> {
        Some(match f.kind {
            FdKind::CharDevice {
                rdev,
                mode,
                uid,
                gid,
            }
            | FdKind::BlockDevice {
                rdev,
                mode,
                uid,
                gid,
            } if ghost::removed(&f.path).is_some() => {
                let block = matches!(f.kind, FdKind::BlockDevice { .. });
                let node = ghost::Node {
                    mode,
                    rdev,
                    owner: (uid, gid),
                };
                ghost_device(cx.r, f, node, block).map(Opened::Ours)
            }
            FdKind::RemovedSymlink {
                ref target,
                uid,
                gid,
            } => ghost::symlink(cx.r, &f.path, target, (uid, gid))
                .and_then(|g| {
                    fdio::dup_own(g).step(|| format!("cannot open {} as fd {}", f.path, f.fd))
                })
                .map(Opened::Ours),
            FdKind::Regular { .. }
            | FdKind::Directory
            | FdKind::CharDevice { .. }
            | FdKind::BlockDevice { .. }
            | FdKind::PathOnly => reopen(cx, f, 0).map(|()| Opened::InStub),
            FdKind::Memfd { object } => {
                description(cx.r, f, ObjectTag::Memfd, object).map(Opened::Ours)
            }
            FdKind::DeletedFile { object } => {
                description(cx.r, f, ObjectTag::DeletedFile, object).map(Opened::Ours)
            }
            _ => return None,
        })
    }
}

/// A regular file that has a name: by that name, or through a link the
/// checkpoint makes when its name was removed and it kept others (see
/// [`relink`]; not at a pre-flight or a `--verify`, which write nothing).
fn regular(cx: &mut FdScan<'_>, f: &OpenFd<'_>, md: &std::fs::Metadata) -> Described {
    let relink = if relink::wanted(&f.link, md) && cx.objects.is_some() && !cx.tree.verifying {
        let open = format!("/proc/{}/fd/{}", f.pid, f.fd);
        Some(relink::make(&open, &f.link, md)?)
    } else {
        None
    };
    Ok(Some(FdKind::Regular {
        size: md.len(),
        relink,
    }))
}

/// An O_PATH fd of a symbolic link removed since: its target (read through
/// a copy of the fd) and owner.
fn removed_symlink(f: &OpenFd<'_>, md: &std::fs::Metadata) -> Described {
    let err = |e: cr_sys::SysError| {
        format!(
            "an O_PATH fd of the removed symbolic link {}, whose target cannot be read: {}",
            f.link,
            cr_sys::error::one_line(&e)
        )
    };
    let copy = fdio::steal_fd(f.pid, f.fd).map_err(err)?;
    let target = fdio::link_target(&copy).map_err(err)?;
    Ok(Some(FdKind::RemovedSymlink {
        target,
        uid: md.uid(),
        gid: md.gid(),
    }))
}

/// The restorer's memfds and unnamed files, by object.
#[derive(Default)]
struct Held {
    files: HashMap<(ObjectTag, u64), OwnedFd>,
    /// A deleted file that mappings showed under other names too (linked
    /// under them before it was deleted): its descriptions through each
    /// (object id, name), as /proc shows the name a mapping's file was
    /// opened by.
    aliases: HashMap<(u64, String), OwnedFd>,
    /// Content objects whose own description (made with O_TMPFILE, or by
    /// memfd_create) was handed out already.
    own_taken: HashSet<u64>,
    /// Descriptions of a deleted file opened with O_NOFOLLOW by its old
    /// path before it was deleted again, by object: (access mode, fd).
    nofollow: HashMap<u64, Vec<(i32, OwnedFd)>>,
}

/// The content of a memfd or deleted file reachable at `open_path` (a /proc
/// magic link), shown to users as `link`, saved as object `ino`.
pub fn content_object(
    objects: &mut Objects,
    open_path: &str,
    ino: u64,
    link: &str,
    memfd: bool,
) -> Result<(), String> {
    let tag = if memfd {
        ObjectTag::Memfd
    } else {
        ObjectTag::DeletedFile
    };
    if objects.contains(tag, ino) {
        return Ok(());
    }
    let err = |e: String| format!("{link}, whose content cannot be saved: {e}");
    let Some(dir) = objects.dir.clone() else {
        return Ok(()); // a pre-flight reads no data
    };
    // Read without touching its access time (the program may look at it):
    // O_NOATIME, which only its owner or a holder of CAP_FOWNER may ask.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOATIME)
        .open(open_path)
        .or_else(|_| File::open(open_path))
        .map_err(|e| err(e.to_string()))?;
    let md = file.metadata().map_err(|e| err(e.to_string()))?;
    let huge_page_size = fdio::huge_page_size(&file)
        .map_err(|e| err(e.to_string()))?
        .unwrap_or(0);
    let name = link.strip_suffix(" (deleted)").unwrap_or(link);
    let (name, seals) = if memfd {
        let owned = OwnedFd::from(file.try_clone().map_err(|e| err(e.to_string()))?);
        let seals = fdio::seals(&owned).unwrap_or(0);
        (
            name.strip_prefix("/memfd:").unwrap_or(name).to_string(),
            seals,
        )
    } else {
        (name.to_string(), 0)
    };
    let content = save_content(
        &dir,
        &objects.image_id,
        &format!("file-{ino}"),
        &file,
        objects.fsync,
    )
    .map_err(err)?;
    let c = FileContent {
        name,
        size: md.len(),
        mode: md.mode() & 0o7777,
        seals,
        content: Some(content),
        atime_ns: md.atime() * 1_000_000_000 + md.atime_nsec(),
        mtime_ns: md.mtime() * 1_000_000_000 + md.mtime_nsec(),
        owner: (!memfd).then(|| (md.uid(), md.gid())),
        huge_page_size,
    };
    objects.insert(Object {
        id: ino,
        kind: if memfd {
            ObjectKind::Memfd(c)
        } else {
            ObjectKind::DeletedFile(c)
        },
    });
    Ok(())
}

/// Save the content of `file` (its data, holes skipped) as content file
/// `what` (e.g. `file-1234`) of image `image_id` in `dir` (its name made
/// unique to the image: see [`ImageDir::content_name`]). Errors in words.
pub fn save_content(
    dir: &cr_image::ImageDir,
    image_id: &str,
    what: &str,
    file: &File,
    fsync: bool,
) -> Result<PageFile, String> {
    let name = &ImageDir::content_name(what, image_id);
    let size = file.metadata().map_err(|e| e.to_string())?.len();
    let writer = PageWriter::create_named(dir, name).map_err(|e| e.to_string())?;
    let ranges =
        cr_sys::mem::data_ranges(file, 0, size).map_err(|e| cr_sys::error::one_line(&e))?;
    let mut extents = Vec::new();
    let mut out_off = 0u64;
    let mut buf = Vec::new();
    for (a, b) in ranges {
        let mut off = a & !(PAGE_SIZE - 1);
        while off < b {
            let len = (b - off).min(RUN);
            let pages = len.div_ceil(PAGE_SIZE);
            buf.clear();
            buf.resize((pages * PAGE_SIZE) as usize, 0);
            let want = len.min(size - off) as usize;
            file.read_exact_at(&mut buf[..want], off)
                .map_err(|e| e.to_string())?;
            writer.write_at(out_off, &buf).map_err(|e| e.to_string())?;
            extents.push(PageExtent {
                file_offset: off,
                pages: pages as u32,
                offset: out_off,
                xxh3: cr_image::checksum(&buf),
            });
            out_off += buf.len() as u64;
            off += pages * PAGE_SIZE;
        }
    }
    writer
        .finish(out_off, extents, fsync)
        .map_err(|e| e.to_string())
}

/// Write the saved content `pf` of a file of `size` bytes back into
/// `file` (its first `size` bytes; each run's checksum verified). A file
/// of hugetlbfs, which takes no write(2), is sized to `size` and filled
/// through a shared map of it.
pub fn refill(
    img: &cr_image::ImageDir,
    pf: &PageFile,
    file: &File,
    size: u64,
    what: &str,
) -> Result<(), RestoreError> {
    let err = |e: std::io::Error| RestoreError::Unsupported(format!("cannot refill {what}: {e}"));
    let reader = PageReader::open(img, pf)?;
    let huge = fdio::huge_page_size(file).is_ok_and(|h| h.is_some());
    let mut map = match huge && size > 0 {
        true => {
            file.set_len(size).map_err(err)?;
            Some(
                cr_sys::mem::FileWindow::map(file, 0, size as usize, what)
                    .step(|| format!("cannot refill {what}"))?,
            )
        }
        false => None,
    };
    let mut buf = Vec::new();
    for ext in &pf.extents {
        reader.read_extent(ext, &mut buf)?;
        let end = (ext.file_offset + buf.len() as u64).min(size);
        let n = end.saturating_sub(ext.file_offset) as usize;
        let at = ext.file_offset;
        match &mut map {
            Some(m) => m.bytes_mut()[at as usize..at as usize + n].copy_from_slice(&buf[..n]),
            None => file.write_all_at(&buf[..n], at).map_err(err)?,
        }
    }
    Ok(())
}

/// A file mapping `v` of the frozen process `cx` whose file exists nowhere
/// else (a memfd, a deleted file): its content object.
pub fn mapping_object(cx: &mut Proc<'_, '_>, v: &Vma) -> Result<Option<u64>, CheckpointError> {
    if !(v.path.starts_with("/memfd:") || v.path.ends_with(" (deleted)")) {
        return Ok(None);
    }
    let link = format!("/proc/{}/map_files/{:x}-{:x}", cx.pid, v.start, v.end);
    // A file really named "x (deleted)" still has a link.
    if !std::fs::metadata(&link).is_ok_and(|m| m.nlink() == 0) {
        return Ok(None);
    }
    let memfd = v.path.starts_with("/memfd:");
    content_object(&mut cx.d.objects, &link, v.inode, &v.path, memfd).map_err(|what| {
        CheckpointError::unsupported(cx.pid, format!("mapping at {:#x} of {what}", v.start))
    })?;
    Ok(Some(v.inode))
}

/// A file mapping `v` of the frozen process `pid` by a name removed while
/// the file kept others: the checkpoint's link to it (see [`relink`]).
pub fn mapping_relink(pid: i32, v: &Vma) -> Result<Option<String>, CheckpointError> {
    if !v.path.ends_with(" (deleted)") || v.path.starts_with("/memfd:") {
        return Ok(None);
    }
    let link = format!("/proc/{pid}/map_files/{:x}-{:x}", v.start, v.end);
    match std::fs::metadata(&link) {
        Ok(md) if relink::wanted(&v.path, &md) => {
            relink::make(&link, &v.path, &md).map(Some).map_err(|what| {
                CheckpointError::unsupported(pid, format!("mapping at {:#x} of {what}", v.start))
            })
        }
        _ => Ok(None),
    }
}

/// A content object made again by [`file_object`].
struct MadeFile {
    fd: OwnedFd,
    /// Its descriptions through other names (`aliases`).
    aliases: Vec<(String, OwnedFd)>,
    /// Descriptions opened by its old path with O_NOFOLLOW, one per
    /// access mode asked for (none when it could not be made there).
    nofollow: Vec<(i32, OwnedFd)>,
}

/// A memfd, or an unnamed file in the directory of a deleted one, holding
/// the saved content.
/// `aliases`: other names of a deleted file, linked to it before it is
/// deleted again, and opened through each (those that could be).
/// `nofollow`: access modes of descriptions to open with O_NOFOLLOW by its
/// path before it is deleted again (the flag cannot be had through /proc).
fn file_object(
    r: &Restorer<'_>,
    obj: &FileContent,
    memfd: bool,
    aliases: &[String],
    nofollow: &[i32],
) -> Result<MadeFile, RestoreError> {
    let mut opened = Vec::new();
    let mut opened_nofollow = Vec::new();
    let fd = if memfd {
        let huge = cr_sys::mem::huge_memfd_flags(obj.huge_page_size);
        fdio::memfd_create(&obj.name, libc::MFD_ALLOW_SEALING | huge).step(|| {
            format!(
                "cannot create memfd {}{}",
                obj.name,
                if huge != 0 {
                    format!(
                        " with huge pages of {} bytes (are any free? /proc/sys/vm/nr_hugepages)",
                        obj.huge_page_size
                    )
                } else {
                    String::new()
                }
            )
        })?
    } else {
        let path = std::path::Path::new(&obj.name);
        let was_tmpfile = path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with('#'));
        // Its directory may have been removed after it (a program's own
        // scratch directory): made again for the while.
        let _made = match path.parent() {
            Some(d) if !was_tmpfile && path.is_absolute() => MadeDirs::make(d),
            _ => MadeDirs(Vec::new()),
        };
        let dir = path
            .parent()
            .filter(|d| d.is_dir())
            .map(|d| d.to_string_lossy().into_owned())
            .unwrap_or_else(|| "/tmp".into());
        // Made again at its old path and unlinked at once, so /proc shows
        // the same "PATH (deleted)"; an O_TMPFILE file (or a path taken
        // meanwhile) becomes an unnamed file of the same directory.
        let named = (!was_tmpfile)
            .then(|| fdio::open(&obj.name, libc::O_CREAT | libc::O_EXCL | libc::O_RDWR).ok())
            .flatten();
        match named {
            Some(fd) => {
                for a in aliases {
                    if std::fs::hard_link(&obj.name, a).is_ok() {
                        if let Ok(afd) = fdio::open(a, libc::O_RDWR) {
                            opened.push((a.clone(), afd));
                        }
                        let _ = std::fs::remove_file(a);
                    }
                }
                for &mode in nofollow {
                    let flags = mode | libc::O_NOFOLLOW | libc::O_NONBLOCK;
                    if let Ok(nfd) = fdio::open(&obj.name, flags) {
                        opened_nofollow.push((mode, nfd));
                    }
                }
                let _ = std::fs::remove_file(&obj.name);
                fd
            }
            None => fdio::open(&dir, libc::O_TMPFILE | libc::O_RDWR).step(|| {
                format!(
                    "cannot create an unnamed file in {dir} for the deleted {}",
                    obj.name
                )
            })?,
        }
    };
    let file = File::from(fd);
    let what =
        |e: std::io::Error| RestoreError::Unsupported(format!("cannot refill {}: {e}", obj.name));
    if let Some(pf) = &obj.content {
        refill(r.img, pf, &file, obj.size, &obj.name)?;
    }
    file.set_len(obj.size).map_err(what)?;
    // A memfd too: its mode says whether it may be executed (0777 made
    // plainly, 0666 with MFD_NOEXEC_SEAL, whose F_SEAL_EXEC the seals below
    // give back), and a program may fchmod it.
    use std::os::unix::fs::PermissionsExt;
    if let Some((uid, gid)) = obj.owner {
        // Before the mode: chown may clear set-user-ID and set-group-ID.
        let md = file.metadata().map_err(what)?;
        if (md.uid(), md.gid()) != (uid, gid) {
            std::os::unix::fs::fchown(&file, Some(uid), Some(gid)).map_err(what)?;
        }
    }
    if file.metadata().map_err(what)?.mode() & 0o7777 != obj.mode {
        file.set_permissions(std::fs::Permissions::from_mode(obj.mode))
            .map_err(what)?;
    }
    let fd = OwnedFd::from(file);
    if obj.mtime_ns != 0 {
        fdio::set_file_times(&fd, obj.atime_ns, obj.mtime_ns)
            .step(|| format!("cannot give {} its times back", obj.name))?;
    }
    if memfd && obj.seals != 0 {
        fdio::add_seals(&fd, obj.seals).step(|| format!("cannot seal memfd {}", obj.name))?;
    }
    Ok(MadeFile {
        fd,
        aliases: opened,
        nofollow: opened_nofollow,
    })
}

/// The directories of a path missing on this host, made (mode 0700) so
/// that a deleted file can be made again at its old path and unlinked;
/// removed again, deepest first, when dropped: /proc then shows the
/// mapping or fd as "PATH (deleted)", as before the checkpoint.
struct MadeDirs(Vec<std::path::PathBuf>);

impl MadeDirs {
    fn make(dir: &std::path::Path) -> MadeDirs {
        use std::os::unix::fs::DirBuilderExt;
        let missing: Vec<&std::path::Path> = dir.ancestors().take_while(|d| !d.exists()).collect();
        let mut made = MadeDirs(Vec::new());
        for d in missing.into_iter().rev() {
            if std::fs::DirBuilder::new().mode(0o700).create(d).is_err() {
                break;
            }
            made.0.push(d.to_path_buf());
        }
        made
    }
}

impl Drop for MadeDirs {
    fn drop(&mut self) {
        for d in self.0.iter().rev() {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// __O_TMPFILE (O_TMPFILE without O_DIRECTORY).
const O_TMPFILE_BIT: i32 = 0o20000000;

/// A new description of the memfd or deleted file behind `f`.
fn description(
    r: &mut Restorer<'_>,
    f: &Fd,
    tag: ObjectTag,
    id: u64,
) -> Result<OwnedFd, RestoreError> {
    let accmode = f.flags as i32 & libc::O_ACCMODE;
    let what = || format!("cannot open {} again as fd {}", f.path, f.fd);
    let held = r.stash.get::<Held>();
    let file = held.files.get(&(tag, id)).ok_or_else(|| {
        RestoreError::Unsupported(format!(
            "fd {} refers to object {id} missing from the image",
            f.fd
        ))
    })?;
    // A file made with O_TMPFILE keeps that in its flags; our own
    // description was made the same way, so the first such fd gets it.
    // Likewise a memfd's read-write fd: the one memfd_create returns does
    // not count as a writer (it is not opened through a path), and only
    // then may the program execute the memfd (execveat AT_EMPTY_PATH);
    // one opened again read-write through /proc would make that ETXTBSY.
    let own_kind = f.flags as i32 & O_TMPFILE_BIT != 0 || tag == ObjectTag::Memfd;
    if own_kind && accmode == libc::O_RDWR && held.own_taken.insert(id) {
        return file
            .try_clone()
            .map_err(|e| RestoreError::Unsupported(format!("{}: {e}", what())));
    }
    if f.flags as i32 & libc::O_NOFOLLOW != 0 {
        let pool = held.nofollow.entry(id).or_default();
        if let Some(i) = pool.iter().position(|(mode, _)| *mode == accmode) {
            return Ok(pool.swap_remove(i).1);
        }
    }
    let file = held.files.get(&(tag, id)).expect("looked up above");
    // O_SYNC and O_DSYNC are set only by open(2) (F_SETFL ignores them).
    let sync = f.flags as i32 & OPEN_TIME_STATUS;
    fdio::reopen(file, accmode | sync).step(what)
}

/// Status flags that only open(2) sets: a new description is opened with
/// them (fcntl F_SETFL leaves them as they are).
pub const OPEN_TIME_STATUS: i32 = libc::O_SYNC | libc::O_DSYNC;

/// A new description, with the flags and offset of `f`, of the device
/// node removed while open that `f` shows (made again as a ghost).
fn ghost_device(
    r: &mut Restorer<'_>,
    f: &Fd,
    node: ghost::Node,
    block: bool,
) -> Result<OwnedFd, RestoreError> {
    let kind = if block { libc::S_IFBLK } else { libc::S_IFCHR };
    // An image without the mode (older): the node is only ours anyway.
    let perm = if node.mode == 0 { 0o600 } else { node.mode };
    let g = ghost::device(
        r,
        &f.path,
        ghost::Node {
            mode: kind | perm,
            ..node
        },
    )?;
    let flags = (f.flags as i32) & !(OPEN_ONLY | libc::O_CLOEXEC);
    let what = || format!("cannot open the removed device {} as fd {}", f.path, f.fd);
    let fd = fdio::open(&format!("/proc/self/fd/{g}"), flags).step(what)?;
    let mut file = File::from(fd);
    if f.pos != 0 {
        use std::io::Seek;
        file.seek(std::io::SeekFrom::Start(f.pos))
            .map_err(|e| RestoreError::Unsupported(format!("{}: {e}", what())))?;
    }
    Ok(OwnedFd::from(file))
}

/// Path through which a process maps the content object `id`, shown to it
/// as `shown` ("NAME (deleted)"; through that name when the deleted file
/// had several).
pub fn map_path(r: &mut Restorer<'_>, id: u64, shown: &str) -> Option<String> {
    let held = r.stash.get::<Held>();
    let name = shown.strip_suffix(" (deleted)").unwrap_or(shown);
    let f = held
        .aliases
        .get(&(id, name.to_string()))
        .or_else(|| held.files.get(&(ObjectTag::Memfd, id)))
        .or_else(|| held.files.get(&(ObjectTag::DeletedFile, id)))?;
    Some(format!("/proc/{}/fd/{}", std::process::id(), f.as_raw_fd()))
}

/// A file, directory or device opened again by path inside the stub, at
/// its number; `extra` open flags are added.
pub fn reopen(cx: &mut Rebuild<'_, '_, '_>, f: &Fd, extra: i32) -> Result<(), RestoreError> {
    let flags = ((f.flags as i32) & !OPEN_ONLY) | extra;
    let cloexec = (flags & libc::O_CLOEXEC) as u64;
    if let FdKind::Regular { .. } = f.kind {
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
    // A directory removed while open is made again (and removed again).
    let ghost = match ghost::removed(&f.path) {
        Some(_) if f.kind == FdKind::Directory => Some(ghost::dir(cx.r, &f.path)?),
        _ => None,
    };
    // A file removed under its name that kept others: by its name made
    // again for the while.
    let relinked = match &f.kind {
        FdKind::Regular {
            relink: Some(link), ..
        } => Some(relink::open_path(cx.r, &f.path, link)?),
        _ => None,
    };
    // A file in /proc/PID of a process that has exited: through a holder
    // of that PID.
    let ghost = match ghost {
        Some(d) => Some((d, ".".to_string())),
        None => ghost::dead_proc_entry(cx.r, &f.path)?,
    };
    let stub = &mut cx.stub;
    let what = || format!("cannot reopen {} as fd {}", f.path, f.fd);
    match (&ghost, &relinked) {
        (Some((d, rel)), _) => {
            let got = stub.open_at_ours(*d, rel, flags).step(what)?;
            if got != f.fd as u64 {
                stub.call("dup3", libc::SYS_dup3, [got, f.fd as u64, cloexec, 0, 0, 0])
                    .step(|| format!("cannot move {} to fd {}", f.path, f.fd))?;
                stub.call("close", libc::SYS_close, [got, 0, 0, 0, 0, 0])?;
            }
        }
        // Opened and moved to its number in one batch with its offset
        // (flushed below): one stop
        // where the open, then the move and the offset, took two to six.
        (None, path) => {
            let path = stub.put_str(path.as_deref().unwrap_or(&f.path))?;
            stub.later_at(
                (
                    "openat",
                    libc::SYS_openat,
                    [libc::AT_FDCWD as u64, path, flags as u64, 0, 0, 0],
                ),
                f.fd,
                cloexec != 0,
                what(),
            )?;
        }
    }
    // An O_PATH fd has no offset (lseek fails with EBADF).
    let seekable = !fds::is_path_only(f.flags)
        && (matches!(f.kind, FdKind::Regular { .. } | FdKind::BlockDevice { .. })
            || (f.kind == FdKind::Directory && f.pos != 0));
    if seekable {
        fds::seek(stub, f)?;
    }
    // The fd is there when this returns (callers take it back at once,
    // e.g. files in flight).
    stub.flush()?;
    Ok(())
}
