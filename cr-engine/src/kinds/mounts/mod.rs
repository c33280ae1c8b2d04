//! Kind "mounts": the mount namespace of a tree that has one of its own (a
//! `cr_run` job, see `cr_sys::ns::job_mounts`). Saved: whether it has a
//! /proc of its own (of its PID namespace), a private tmpfs on /dev/shm,
//! with every directory, file (content in the image, holes kept) and
//! symbolic link in it, their modes, owners and times, and a devpts
//! instance of its own (the ptys in it are objects of kind tty). Other
//! mounts made inside the namespace are not saved (a warning names them):
//! the restored tree sees the restorer's.
//!
//! Restore: the root's stub is created in a new mount namespace (a copy of
//! the restorer's, see `kinds::tree::restore`), where it mounts /proc,
//! /dev/shm and a new devpts instance again by injected calls (so /proc
//! shows its PID namespace); the restorer then fills /dev/shm and makes the
//! job's ptys at their numbers in its devpts, both through
//! `/proc/ROOT/root`, before any process is rebuilt (their fds and
//! mappings of /dev/shm files are opened by path, inside the namespace).

use crate::capture::Dump;
use crate::error::{CheckpointError, RestoreError, StepContext};
use crate::kinds::files;
use crate::restore::Restorer;
use cr_image::model::{MountNs, Process, Tmpfs, TmpfsEntry, TmpfsKind};
use cr_sys::ptrace::Tracee;
use cr_sys::{fdio, mem, ns, SysError};
use std::fs::File;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use tracing::{debug, warn};

/// The statfs magics of proc, tmpfs and devpts.
const PROC_MAGIC: i64 = 0x9fa0;
const TMPFS_MAGIC: i64 = 0x0102_1994;
pub(crate) const DEVPTS_MAGIC: i64 = 0x1cd1;

/// Whether `path` (seen through `/proc/ROOT/root`) is a mount of `magic`
/// other than ours at `ours`.
fn own_mount(path: &Path, ours: &str, magic: i64) -> bool {
    let (Ok(a), Ok(b)) = (std::fs::metadata(path), std::fs::metadata(ours)) else {
        return false;
    };
    a.dev() != b.dev() && fdio::fs_magic_at(path).is_ok_and(|m| m == magic)
}

/// The mount namespace of the frozen tree, when it has one of its own.
pub fn capture(d: &Dump<'_>, images: &[Process]) -> Result<Option<MountNs>, CheckpointError> {
    let Some(root) = images.first().map(|p| p.pid as i32) else {
        return Ok(None);
    };
    let sys = |pid: i32| move |e| CheckpointError::from_sys(pid, e);
    if !ns::differs(root, "mnt").map_err(sys(root))? {
        return Ok(None);
    }
    crate::kinds::tree::same_namespace(images, "mnt", "a mount")?;
    let top = PathBuf::from(format!("/proc/{root}/root"));
    let proc = own_mount(&top.join("proc"), "/proc", PROC_MAGIC);
    let shm_path = top.join(ns::DEV_SHM.trim_start_matches('/'));
    let dev_shm = if own_mount(&shm_path, ns::DEV_SHM, TMPFS_MAGIC) {
        Some(save_tmpfs(d, &shm_path).map_err(|what| {
            CheckpointError::unsupported(root, format!("{}: {what}", ns::DEV_SHM))
        })?)
    } else {
        None
    };
    let devpts = own_mount(
        &top.join(ns::DEV_PTS.trim_start_matches('/')),
        ns::DEV_PTS,
        DEVPTS_MAGIC,
    );
    warn_other_mounts(root);
    debug!(
        root,
        proc,
        dev_shm = dev_shm.is_some(),
        devpts,
        "mount namespace saved"
    );
    Ok(Some(MountNs {
        proc,
        dev_shm,
        devpts,
    }))
}

/// Mount points of the tree's namespace that ours lacks, but those made
/// again at restore.
fn warn_other_mounts(root: i32) {
    let points = |pid: &str| -> Vec<String> {
        std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
            .collect()
    };
    let ours = points("self");
    let extra: Vec<String> = points(&root.to_string())
        .into_iter()
        .filter(|m| {
            !ours.contains(m)
                && !["/proc", ns::DEV_SHM, ns::DEV_PTS, ns::DEV_PTMX]
                    .iter()
                    .any(|k| m == k || m.starts_with(&format!("{k}/")))
        })
        .collect();
    if !extra.is_empty() {
        warn!(root, mounts = ?extra, "mounts made inside the tree's mount namespace are not saved; the restored tree sees the restorer's");
    }
}

/// Every entry of the tmpfs at `top`, parents first, file contents saved.
fn save_tmpfs(d: &Dump<'_>, top: &Path) -> Result<Tmpfs, String> {
    let md = std::fs::metadata(top).map_err(|e| e.to_string())?;
    let mut out = Tmpfs {
        mode: md.mode() & 0o7777,
        entries: Vec::new(),
    };
    let mut dirs = vec![String::new()];
    while let Some(rel) = dirs.pop() {
        let here = top.join(&rel);
        let mut names: Vec<_> = std::fs::read_dir(&here)
            .map_err(|e| format!("{}: {e}", here.display()))?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<Result<_, _>>()
            .map_err(|e| format!("{}: {e}", here.display()))?;
        names.sort();
        for name in names {
            let name = name
                .into_string()
                .map_err(|n| format!("the name {n:?} is not UTF-8"))?;
            let path = if rel.is_empty() {
                name
            } else {
                format!("{rel}/{name}")
            };
            let full = top.join(&path);
            let md = std::fs::symlink_metadata(&full).map_err(|e| format!("{path}: {e}"))?;
            let ft = md.file_type();
            let kind = if ft.is_dir() {
                dirs.push(path.clone());
                TmpfsKind::Dir
            } else if ft.is_symlink() {
                let t = std::fs::read_link(&full).map_err(|e| format!("{path}: {e}"))?;
                TmpfsKind::Symlink {
                    target: t.to_string_lossy().into_owned(),
                }
            } else if ft.is_file() {
                let f = File::open(&full).map_err(|e| format!("{path}: {e}"))?;
                let n = out.entries.len();
                let content = files::save_content(
                    d.dir,
                    d.image_id,
                    &format!("shm-file-{n}"),
                    &f,
                    d.opts.fsync(),
                )
                .map_err(|e| format!("{path}: {e}"))?;
                TmpfsKind::File {
                    size: md.len(),
                    content: Some(content),
                }
            } else {
                return Err(format!("{path} is a special file (not supported)"));
            };
            out.entries.push(TmpfsEntry {
                path,
                mode: md.mode() & 0o7777,
                uid: md.uid(),
                gid: md.gid(),
                mtime_ns: md.mtime() * 1_000_000_000 + md.mtime_nsec(),
                kind,
            });
        }
    }
    // Parents before children, whatever order the walk took.
    out.entries
        .sort_by(|a, b| a.path.split('/').cmp(b.path.split('/')));
    Ok(out)
}

/// Make the mounts of the image's namespace in the new mount namespace of
/// the root stub `root` (before it forks the others), then fill /dev/shm.
pub fn prepare(r: &mut Restorer<'_>, root: &mut Tracee) -> Result<(), RestoreError> {
    let Some(m) = &r.ck.mounts else {
        return Ok(());
    };
    let mounts = ns::job_mounts(m.proc, m.dev_shm.as_ref().map(|t| t.mode), m.devpts);
    inject_mounts(root, &mounts)?;
    if let Some(t) = &m.dev_shm {
        let top = PathBuf::from(format!("/proc/{}/root{}", root.tid(), ns::DEV_SHM));
        fill_tmpfs(r, &top, t)?;
    }
    if m.devpts {
        // The job's ptys, at their numbers, in its new devpts instance.
        let ptmx = PathBuf::from(format!("/proc/{}/root{}/ptmx", root.tid(), ns::DEV_PTS));
        crate::kinds::tty::make_ptys(r, &ptmx)?;
    }
    debug!(
        root = root.tid(),
        proc = m.proc,
        devpts = m.devpts,
        "mount namespace made"
    );
    Ok(())
}

/// Run `mount` for each of `mounts` in the stub `t`.
fn inject_mounts(t: &mut Tracee, mounts: &[ns::Mount]) -> Result<(), RestoreError> {
    let pid = t.tid();
    crate::kinds::tree::restore::inject_with_page(t, |inj, page| {
        for m in mounts {
            // source, target, fstype, data: NUL-terminated, one after the other.
            let mut bytes = Vec::new();
            let mut at = Vec::new();
            for s in [m.source, m.target, m.fstype, m.data.as_str()] {
                at.push(page + bytes.len() as u64);
                bytes.extend(mem::cstring_bytes(s));
            }
            mem::write_vm(pid, page, &bytes)?;
            let fstype = if m.fstype.is_empty() { 0 } else { at[2] };
            let data = if m.data.is_empty() { 0 } else { at[3] };
            inj.call(
                "mount",
                libc::SYS_mount,
                [at[0], at[1], fstype, m.flags, data, 0],
            )
            .step(|| {
                format!(
                    "cannot mount {} on {} for the restored job",
                    m.source, m.target
                )
            })?;
        }
        Ok(())
    })
}

/// Make every entry of `t` under `top` (the new tmpfs), then their times.
fn fill_tmpfs(r: &Restorer<'_>, top: &Path, t: &Tmpfs) -> Result<(), RestoreError> {
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source| SysError::Io { path, source }
    };
    for e in &t.entries {
        let p = top.join(&e.path);
        let what = || format!("cannot restore {}/{}", ns::DEV_SHM, e.path);
        match &e.kind {
            TmpfsKind::Dir => std::fs::create_dir(&p).map_err(io(&p)).step(what)?,
            TmpfsKind::Symlink { target } => std::os::unix::fs::symlink(target, &p)
                .map_err(io(&p))
                .step(what)?,
            TmpfsKind::File { size, content } => {
                let f = File::create(&p).map_err(io(&p)).step(what)?;
                if let Some(pf) = content {
                    files::refill(r.img, pf, &f, *size, &e.path)?;
                }
                f.set_len(*size).map_err(io(&p)).step(what)?;
            }
        }
        std::os::unix::fs::lchown(&p, Some(e.uid), Some(e.gid))
            .map_err(io(&p))
            .step(what)?;
        if !matches!(e.kind, TmpfsKind::Symlink { .. }) {
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(e.mode))
                .map_err(io(&p))
                .step(what)?;
        }
    }
    // Times last (making an entry changes its directory's); children first.
    for e in t.entries.iter().rev() {
        let p = top.join(&e.path);
        fdio::set_times_nofollow(&p, e.mtime_ns)
            .step(|| format!("cannot set the time of {}", p.display()))?;
    }
    Ok(())
}
