//! Kind "outside": the files outside the image that its processes rely on
//! — regular files and directories they hold open, files they map (the
//! executable and its libraries with their ELF build id), their working
//! directories — recorded as they were (type, size, mtime, device, inode),
//! so that a restore never runs on files that changed or are gone without
//! saying so; and, when asked (`--save-files`, `--save-file`), their
//! content, so the image is self-contained.
//!
//! Capture ([`capture`]) runs once the processes are captured, while the
//! tree is still frozen: it looks at each file through /proc (the fd, the
//! `map_files` link, `exe`, `cwd`), so it sees the very file the process
//! uses, also inside a job's own mount namespace. Pseudo files (/proc,
//! /sys, /dev) and files whose content is in the image anyway (memfds,
//! deleted files, a job's own /dev/shm) are left out.
//!
//! Restore ([`check`]) runs before anything of the image is made: a saved
//! file that differs is put back from the image; any other change refuses
//! the restore with one line naming the file, its user and the change,
//! unless `--allow-changed-files`. Rules:
//! - an ELF file with a build id is the same file if its build id is
//!   (a package reinstalled with the same build changes only its mtime);
//! - a directory only has to exist (files come and go in it);
//! - an output file (every use a write-only fd: a log, a redirected
//!   stdout) may have been written since, as long as it lost nothing it
//!   had (not shorter) and is the same file: the processes never read it,
//!   and the restored ones write on from where they were;
//! - anything else must keep its size and mtime, and on the same boot its
//!   device and inode (a file replaced by rename is another file).

#[cfg(test)]
mod tests;

use crate::capture::Dump;
use crate::error::{CheckpointError, RestoreError};
use crate::kinds::files;
use crate::options::RestoreOptions;
use cr_image::model::{
    objects::FileContent, Checkpoint, FdKind, Object, ObjectKind, ObjectTag, OutsideFile, Process,
    VmaKind,
};
use cr_image::ImageDir;
use std::collections::BTreeMap;
use std::fs::{File, Metadata};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use tracing::{debug, warn};

/// Paths whose files are not contents on a disk.
const PSEUDO: &[&str] = &["/proc/", "/sys/", "/dev/"];

/// One use of a file by a frozen process: its path, how to reach the very
/// file (a /proc link), what uses it.
struct Use {
    path: String,
    link: String,
    used_by: String,
    /// A write-only fd.
    write_only: bool,
    /// An open fd or a writable shared mapping (a candidate for
    /// `--save-files`).
    open: bool,
    /// Mapped executable: its build id is worth reading.
    elf: bool,
    /// Its build id is known already (the executable's, kind "task").
    build_id: Option<Vec<u8>>,
}

/// The outside files of the captured `images` (`procs[i]` is the host pid
/// of `images[i]`), with contents saved as asked. `own_dev_shm`: the job
/// has its own /dev/shm, saved by kind "mounts"; `made`: the mount points
/// kind "mounts" makes again (what is under them is not an outside file:
/// a tmpfs's contents are in the image, a bind mount shows the restorer's
/// files).
pub fn capture(
    d: &mut Dump<'_>,
    pids: &[i32],
    images: &[Process],
    own_dev_shm: bool,
    made: &[String],
) -> Result<Vec<OutsideFile>, CheckpointError> {
    let under_made = |path: &str| {
        made.iter()
            .any(|m| path == m || path.starts_with(&format!("{}/", m.trim_end_matches('/'))))
    };
    let root = pids.first().copied().unwrap_or(0);
    let mut found: BTreeMap<String, (OutsideFile, String, bool)> = BTreeMap::new();
    for (&hp, p) in pids.iter().zip(images) {
        if p.is_zombie() {
            continue;
        }
        for u in uses(hp, p) {
            if skipped(&u.path, own_dev_shm) || under_made(&u.path) {
                continue;
            }
            if let Some((f, _, open)) = found.get_mut(&u.path) {
                f.write_only &= u.write_only;
                *open |= u.open;
                continue;
            }
            // The file may have gone between reading the link and now
            // (never while frozen by the tree itself): left out.
            let Ok(md) = std::fs::metadata(&u.link) else {
                debug!(path = %u.path, "outside file vanished while looked at");
                continue;
            };
            if !(md.is_file() || md.is_dir()) {
                continue;
            }
            let build_id = match u.build_id {
                Some(b) => b,
                None if u.elf && md.is_file() => {
                    cr_sys::elf::file_build_id(&u.link).unwrap_or_default()
                }
                None => Vec::new(),
            };
            let f = identity(&u.path, &u.used_by, &md, build_id, u.write_only);
            found.insert(u.path.clone(), (f, u.link, u.open));
        }
    }
    let listed = listed(&d.opts.save_file).map_err(CheckpointError::Invalid)?;
    for (path, md) in &listed {
        found.entry(path.clone()).or_insert_with(|| {
            let f = identity(path, "listed with --save-file", md, Vec::new(), false);
            (f, path.clone(), true)
        });
    }
    let mut out = Vec::with_capacity(found.len());
    let mut next_id = 1;
    for (path, (mut f, link, open)) in found {
        let regular = f.mode & libc::S_IFMT == libc::S_IFREG;
        f.listed = listed.iter().any(|(p, _)| *p == path);
        let wanted = f.listed || (open && d.opts.save_files.is_some_and(|limit| f.size <= limit));
        if regular && wanted {
            f.saved = Some(save(d, root, &f, &link, next_id)?);
            next_id += 1;
        }
        out.push(f);
    }
    Ok(out)
}

/// The files named with `--save-file`, by absolute path, each a regular
/// file: checked before anything is frozen, and again in the dump.
pub fn listed(paths: &[std::path::PathBuf]) -> Result<Vec<(String, Metadata)>, String> {
    paths
        .iter()
        .map(|p| {
            let bad = |e: String| format!("--save-file {}: {e}", p.display());
            let abs = std::fs::canonicalize(p).map_err(|e| bad(e.to_string()))?;
            let md = std::fs::metadata(&abs).map_err(|e| bad(e.to_string()))?;
            if !md.is_file() {
                return Err(bad("not a regular file".into()));
            }
            Ok((abs.to_string_lossy().into_owned(), md))
        })
        .collect()
}

/// Every file `p` (host pid `hp`) uses: executable, cwd, open regular
/// files and directories, file mappings.
fn uses(hp: i32, p: &Process) -> Vec<Use> {
    let mut v = Vec::new();
    let one = |path: &str, link: String, used_by: String| Use {
        path: path.to_string(),
        link,
        used_by,
        write_only: false,
        open: false,
        elf: false,
        build_id: None,
    };
    if !p.task.exe.is_empty() {
        let mut u = one(
            &p.task.exe,
            format!("/proc/{hp}/exe"),
            format!("the executable of process {}", p.pid),
        );
        u.build_id = Some(p.task.exe_build_id.clone());
        v.push(u);
    }
    if !p.task.cwd.is_empty() {
        v.push(one(
            &p.task.cwd,
            format!("/proc/{hp}/cwd"),
            format!("the working directory of process {}", p.pid),
        ));
    }
    for f in &p.fds {
        if matches!(f.kind, FdKind::Regular { .. } | FdKind::Directory) {
            let mut u = one(
                &f.path,
                format!("/proc/{hp}/fd/{}", f.fd),
                format!("fd {} of process {}", f.fd, p.pid),
            );
            u.write_only = f.flags as i32 & libc::O_ACCMODE == libc::O_WRONLY;
            u.open = true;
            v.push(u);
        }
    }
    for m in &p.vmas {
        if matches!(m.kind, VmaKind::FilePrivate | VmaKind::FileShared) && m.object.is_none() {
            let mut u = one(
                &m.path,
                format!("/proc/{hp}/map_files/{:x}-{:x}", m.start, m.end),
                format!("a mapping of process {}", p.pid),
            );
            u.elf = m.prot & libc::PROT_EXEC as u32 != 0;
            // A file the process writes through its memory is part of its
            // state, like an open one: saved with --save-files.
            u.open = m.kind == VmaKind::FileShared && m.prot & libc::PROT_WRITE as u32 != 0;
            v.push(u);
        }
    }
    v
}

fn skipped(path: &str, own_dev_shm: bool) -> bool {
    !path.starts_with('/')
        || path.ends_with(" (deleted)")
        || (own_dev_shm && path.starts_with("/dev/shm/"))
        || (PSEUDO.iter().any(|p| path.starts_with(p)) && !path.starts_with("/dev/shm/"))
}

fn identity(
    path: &str,
    used_by: &str,
    md: &Metadata,
    build_id: Vec<u8>,
    write_only: bool,
) -> OutsideFile {
    OutsideFile {
        path: path.to_string(),
        used_by: used_by.to_string(),
        mode: md.mode(),
        size: if md.is_file() { md.len() } else { 0 },
        mtime_ns: mtime_ns(md),
        dev: md.dev(),
        ino: md.ino(),
        build_id,
        saved: None,
        write_only,
        listed: false,
    }
}

fn mtime_ns(md: &Metadata) -> i64 {
    md.mtime() * 1_000_000_000 + md.mtime_nsec()
}

/// Store the content of outside file `f` (reached through `link`) as
/// object `id`.
fn save(
    d: &mut Dump<'_>,
    root: i32,
    f: &OutsideFile,
    link: &str,
    id: u64,
) -> Result<u64, CheckpointError> {
    let err = |what: String| {
        CheckpointError::Invalid(format!(
            "cannot save {} (process {root}) into the image: {what}",
            f.path
        ))
    };
    let file = File::open(link).map_err(|e| err(e.to_string()))?;
    let content = files::save_content(
        d.dir,
        d.image_id,
        &format!("saved-{id}"),
        &file,
        d.opts.fsync(),
    )
    .map_err(err)?;
    d.objects.insert(Object {
        id,
        kind: ObjectKind::SavedFile(FileContent {
            name: f.path.clone(),
            size: f.size,
            mode: f.mode & 0o7777,
            seals: 0,
            content: Some(content),
            atime_ns: 0,
            mtime_ns: 0,
            owner: None,
            huge_page_size: 0,
        }),
    });
    Ok(id)
}

/// Before a restore: put back the saved files that differ, and refuse
/// (unless allowed) when another outside file changed.
pub fn check(ck: &Checkpoint, img: &ImageDir, opts: &RestoreOptions) -> Result<(), RestoreError> {
    let same_boot = ck.meta.boot_id == cr_sys::proc::sys_value("/proc/sys/kernel/random/boot_id");
    for f in &ck.outside_files {
        if let Some(id) = f.saved {
            if change(f, same_boot).is_some() {
                put_back(ck, img, f, id)?;
            }
            continue;
        }
        if let Some(change) = change(f, same_boot) {
            let e = RestoreError::ChangedFile {
                path: f.path.clone(),
                used_by: f.used_by.clone(),
                change,
            };
            if !opts.allow_changed_files {
                return Err(e);
            }
            warn!("{e}");
        }
    }
    Ok(())
}

/// How outside file `f` differs now from the image's record (None: it
/// does not, by the rules of this module).
pub fn change(f: &OutsideFile, same_boot: bool) -> Option<String> {
    let md = match std::fs::metadata(&f.path) {
        Ok(md) => md,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Some("is gone".into()),
        Err(e) => return Some(format!("cannot be looked at ({e})")),
    };
    let was_dir = f.mode & libc::S_IFMT == libc::S_IFDIR;
    if md.is_dir() != was_dir || !(md.is_dir() || md.is_file()) {
        return Some(format!(
            "is now {}, was {}",
            type_name(md.mode()),
            type_name(f.mode)
        ));
    }
    if was_dir {
        return None;
    }
    if !f.build_id.is_empty() {
        let now = cr_sys::elf::file_build_id(&f.path).unwrap_or_default();
        return (now != f.build_id).then(|| {
            format!(
                "is another build (build id {}, was {})",
                hex(&now),
                hex(&f.build_id)
            )
        });
    }
    let size = md.len();
    if same_boot && (md.dev(), md.ino()) != (f.dev, f.ino) {
        return Some(format!("was replaced (inode {}, was {})", md.ino(), f.ino));
    }
    if f.write_only && size >= f.size {
        debug!(path = %f.path, grew = size - f.size, "output file written since the checkpoint");
        return None;
    }
    if size != f.size {
        return Some(format!("has {size} bytes, had {}", f.size));
    }
    if mtime_ns(&md) != f.mtime_ns {
        return Some(format!(
            "was modified (mtime {}, was {})",
            when(mtime_ns(&md)),
            when(f.mtime_ns)
        ));
    }
    None
}

/// Write saved file `f` (object `id`) back at its path, as it was.
fn put_back(ck: &Checkpoint, img: &ImageDir, f: &OutsideFile, id: u64) -> Result<(), RestoreError> {
    let Some(ObjectKind::SavedFile(c)) = ck.object(ObjectTag::SavedFile, id).map(|o| &o.kind)
    else {
        return Err(RestoreError::Unsupported(format!(
            "the saved content of {} is missing",
            f.path
        )));
    };
    let err =
        |e: std::io::Error| RestoreError::Unsupported(format!("cannot put back {}: {e}", f.path));
    let existed = std::path::Path::new(&f.path).exists();
    if let Some(parent) = std::path::Path::new(&f.path).parent() {
        std::fs::create_dir_all(parent).map_err(err)?;
    }
    // In place (same inode, owner and links when it still exists).
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(c.mode)
        .open(&f.path)
        .map_err(err)?;
    if let Some(pf) = &c.content {
        files::refill(img, pf, &file, c.size, &f.path)?;
    }
    file.set_len(c.size).map_err(err)?;
    file.set_permissions(std::fs::Permissions::from_mode(c.mode))
        .map_err(err)?;
    drop(file);
    cr_sys::fdio::set_times_nofollow(std::path::Path::new(&f.path), f.mtime_ns)?;
    if existed {
        warn!(path = %f.path, used_by = %f.used_by, "file changed since the checkpoint: put back from the image");
    } else {
        warn!(path = %f.path, used_by = %f.used_by, "file gone since the checkpoint: put back from the image");
    }
    Ok(())
}

fn type_name(mode: u32) -> &'static str {
    match mode & libc::S_IFMT {
        libc::S_IFREG => "a regular file",
        libc::S_IFDIR => "a directory",
        libc::S_IFLNK => "a symbolic link",
        libc::S_IFIFO => "a fifo",
        libc::S_IFSOCK => "a socket",
        libc::S_IFCHR => "a character device",
        libc::S_IFBLK => "a block device",
        _ => "something else",
    }
}

fn hex(b: &[u8]) -> String {
    if b.is_empty() {
        return "none".into();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A time in nanoseconds since the epoch, as RFC 3339 (UTC).
fn when(ns: i64) -> String {
    let t = std::time::UNIX_EPOCH
        + std::time::Duration::new(
            ns.max(0) as u64 / 1_000_000_000,
            (ns.max(0) % 1_000_000_000) as u32,
        );
    humantime::format_rfc3339_nanos(t).to_string()
}
