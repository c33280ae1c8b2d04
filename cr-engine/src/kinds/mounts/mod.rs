//! Kind "mounts": the mount namespace of a tree that has one of its own (a
//! `cr_run` job, see `cr_sys::ns::job_mounts`). Saved: whether it has a
//! /proc of its own (of its PID namespace), a private tmpfs on /dev/shm,
//! with every directory, file (content in the image, holes kept) and
//! symbolic link in it, their modes, owners and times, and a devpts
//! instance of its own (the ptys in it are objects of kind tty). The other
//! mounts made inside the namespace (those ours lacks) are saved in
//! mountinfo order with their per-mount flags and propagation: bind mounts
//! of a directory or file the checkpointer reaches (by its path here), new
//! tmpfs (contents saved like /dev/shm's), proc, sysfs, mqueue and devpts
//! instances. Any other (a block device's file system, overlay, fuse,
//! nfs..., a bind of a mount made inside the namespace, a mount hidden under
//! another, one whose mount point is gone) is refused by name; a bind of a
//! namespace file (nsfs) is left out with a warning. A tree whose
//! root directory is not ours (a container that pivoted its root) keeps the
//! old behaviour: its other mounts are only warned about.
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
use cr_image::model::{
    Mount, MountKind, MountNs, Process, Propagation, Tmpfs, TmpfsEntry, TmpfsKind, NEW_FS_TYPES,
};
use cr_sys::proc::MountEntry;
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
        Some(save_tmpfs(d, &shm_path, "shm-file").map_err(|what| {
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
    let others = if same_root(root) {
        capture_others(d, root, &top)?
    } else {
        warn_other_mounts(root);
        Vec::new()
    };
    debug!(
        root,
        proc,
        dev_shm = dev_shm.is_some(),
        devpts,
        others = others.len(),
        "mount namespace saved"
    );
    Ok(Some(MountNs {
        proc,
        dev_shm,
        devpts,
        others,
    }))
}

/// Whether the root directory of process `pid` is ours (not a container
/// that pivoted its root).
fn same_root(pid: i32) -> bool {
    match (
        std::fs::metadata(format!("/proc/{pid}/root")),
        std::fs::metadata("/"),
    ) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// The mount points made again by `job_mounts` (and what is under them).
const JOB_POINTS: [&str; 4] = ["/proc", ns::DEV_SHM, ns::DEV_PTS, ns::DEV_PTMX];

fn is_job_point(m: &str) -> bool {
    JOB_POINTS
        .iter()
        .any(|k| m == *k || m.starts_with(&format!("{k}/")))
}

/// The MS_* flags of a mount's per-mount options.
fn mount_flags(options: &[String]) -> u64 {
    let has = |o: &str| options.iter().any(|x| x == o);
    let mut f = 0;
    for (o, bit) in [
        ("ro", libc::MS_RDONLY),
        ("nosuid", libc::MS_NOSUID),
        ("nodev", libc::MS_NODEV),
        ("noexec", libc::MS_NOEXEC),
        ("noatime", libc::MS_NOATIME),
        ("nodiratime", libc::MS_NODIRATIME),
        ("relatime", libc::MS_RELATIME),
    ] {
        if has(o) {
            f |= bit;
        }
    }
    if !has("noatime") && !has("relatime") {
        f |= libc::MS_STRICTATIME;
    }
    f
}

/// The super options of `m` worth giving again at mount, those of `keep`.
fn fs_data(m: &MountEntry, keep: &[&str]) -> Vec<String> {
    m.super_options
        .iter()
        .filter(|o| keep.contains(&o.split('=').next().unwrap_or("")))
        .cloned()
        .collect()
}

/// The mounts of the tree's namespace (of root `root`, its root directory
/// seen at `top`) ours lacks, but those of `job_mounts`: how to make each
/// again, or the refusal naming the first that cannot be.
fn capture_others(d: &Dump<'_>, root: i32, top: &Path) -> Result<Vec<Mount>, CheckpointError> {
    let sys = |e| CheckpointError::from_sys(root, e);
    let theirs = cr_sys::proc::mountinfo(root).map_err(sys)?;
    let ours = cr_sys::proc::mountinfo(std::process::id() as i32).map_err(sys)?;
    let known = |m: &MountEntry| {
        ours.iter()
            .any(|o| o.mount_point == m.mount_point && o.majmin == m.majmin && o.root == m.root)
    };
    let mut made: Vec<&MountEntry> = Vec::new();
    let mut out = Vec::new();
    for (i, m) in theirs.iter().enumerate() {
        if known(m) || is_job_point(&m.mount_point) {
            continue;
        }
        let refuse = |why: String| {
            CheckpointError::unsupported(
                root,
                format!(
                    "the mount on {} ({} of {}) made inside the tree's mount namespace: {why}",
                    m.mount_point, m.fs_type, m.source
                ),
            )
        };
        if m.fs_type == "nsfs" {
            // A copy of a namespace file bound on the host (`ip netns`'s
            // /run/netns entries, copied when the namespace was made, then
            // gone from ours): not made again.
            warn!(root, mount_point = %m.mount_point, "a bind mount of a namespace file inside the tree's mount namespace is not saved");
            continue;
        }
        if m.mount_point.ends_with("//deleted") {
            return Err(refuse("its mount point is gone".into()));
        }
        // Whether a later mount hides it (its contents cannot be read).
        let hidden = theirs[i + 1..]
            .iter()
            .any(|o| o.mount_point == m.mount_point);
        let seen = top.join(m.mount_point.trim_start_matches('/'));
        let kind = if let Some(o) = made.iter().find(|o| o.majmin == m.majmin) {
            return Err(refuse(format!(
                "a bind mount of the mount on {} (made inside the namespace too): not supported",
                o.mount_point
            )));
        } else if ours.iter().any(|o| o.majmin == m.majmin) {
            MountKind::Bind(bind_source(&ours, m, &seen, hidden).map_err(refuse)?)
        } else if m.fs_type == "tmpfs" && m.root == "/" {
            if hidden {
                return Err(refuse(
                    "another mount over it hides its contents: not supported".into(),
                ));
            }
            let name = format!("tmpfs-{}-file", out.len());
            MountKind::Tmpfs(save_tmpfs(d, &seen, &name).map_err(refuse)?)
        } else if NEW_FS_TYPES.contains(&m.fs_type.as_str()) && m.root == "/" {
            MountKind::Fs(m.fs_type.clone())
        } else {
            return Err(refuse(format!(
                "mounts of file system type {} are not saved (only bind mounts of paths the checkpointer reaches, tmpfs, proc, sysfs, mqueue and devpts)",
                m.fs_type
            )));
        };
        let data = match &kind {
            MountKind::Tmpfs(t) => {
                let mut v = fs_data(
                    m,
                    &[
                        "size",
                        "nr_inodes",
                        "uid",
                        "gid",
                        "huge",
                        "inode64",
                        "noswap",
                    ],
                );
                v.push(format!("mode={:o}", t.mode));
                v
            }
            MountKind::Fs(f) if f == "proc" => fs_data(m, &["hidepid", "subset", "gid"]),
            MountKind::Fs(f) if f == "devpts" => {
                let mut v = fs_data(m, &["gid", "mode", "ptmxmode", "max"]);
                v.push("newinstance".into());
                v
            }
            _ => Vec::new(),
        }
        .join(",");
        let propagation = if m.shared.is_some() {
            Propagation::Shared
        } else if m.master.is_some() {
            Propagation::Slave
        } else {
            Propagation::Private
        };
        made.push(m);
        out.push(Mount {
            mount_point: m.mount_point.clone(),
            kind,
            flags: mount_flags(&m.options),
            data,
            propagation,
        });
    }
    Ok(out)
}

/// The path, in our namespace, of what the bind mount `m` shows (seen at
/// `seen` through the tree's root unless `hidden` under another mount):
/// under one of our mounts of its file system whose root holds its root.
fn bind_source(
    ours: &[MountEntry],
    m: &MountEntry,
    seen: &Path,
    hidden: bool,
) -> Result<String, String> {
    let under = |o: &MountEntry| {
        let r = o.root.trim_end_matches('/');
        m.root == o.root || m.root.starts_with(&format!("{r}/"))
    };
    let o = ours
        .iter()
        .filter(|o| o.majmin == m.majmin && under(o))
        .max_by_key(|o| o.root.len())
        .ok_or_else(|| {
            format!(
                "its source ({} of device {}) is not reachable from the checkpointer's mount namespace",
                m.root, m.majmin
            )
        })?;
    let rest = m.root[o.root.len()..].trim_start_matches('/');
    let src = if rest.is_empty() {
        o.mount_point.clone()
    } else {
        format!("{}/{rest}", o.mount_point.trim_end_matches('/'))
    };
    let md = std::fs::metadata(&src).map_err(|e| format!("its source {src}: {e}"))?;
    if !hidden {
        let there = std::fs::metadata(seen).map_err(|e| format!("{}: {e}", seen.display()))?;
        if (there.dev(), there.ino()) != (md.dev(), md.ino()) {
            return Err(format!(
                "its source ({}) is not reachable from the checkpointer's mount namespace ({src} is another file)",
                m.root
            ));
        }
    }
    Ok(src)
}

/// `--verify`: each other mount of the image is in the namespace of the
/// live root `root` (the same number of times at its mount point), of the
/// same kind (a bind mount shows a file system of ours, the others their
/// type) with the same per-mount flags; the first difference in words.
pub fn verify(ck: &cr_image::model::Checkpoint, root: i32) -> Option<String> {
    let m = ck.mounts.as_ref()?;
    if m.others.is_empty() {
        return None;
    }
    let now = match cr_sys::proc::mountinfo(root) {
        Ok(v) => v,
        Err(e) => return Some(format!("mounts: cannot read them: {e}")),
    };
    // The image's mounts at a mount point are the last ones there (those
    // before come with the namespace copied from the restorer's).
    let mut nth: std::collections::HashMap<&str, usize> = Default::default();
    for o in &m.others {
        let n = nth.entry(o.mount_point.as_str()).or_default();
        let at: Vec<&MountEntry> = now
            .iter()
            .filter(|e| e.mount_point == o.mount_point)
            .collect();
        let total = m
            .others
            .iter()
            .filter(|x| x.mount_point == o.mount_point)
            .count();
        let Some(e) = (at.len() + *n).checked_sub(total).and_then(|i| at.get(i)) else {
            return Some(format!("mounts: {} is not mounted", o.mount_point));
        };
        *n += 1;
        let kind_ok = match &o.kind {
            MountKind::Bind(_) => true,
            MountKind::Tmpfs(_) => e.fs_type == "tmpfs",
            MountKind::Fs(f) => e.fs_type == *f,
        };
        if !kind_ok {
            return Some(format!(
                "mounts: {} is a {} mount, the image has another kind",
                o.mount_point, e.fs_type
            ));
        }
        let flags = mount_flags(&e.options);
        if flags != o.flags {
            return Some(format!(
                "mounts: the flags of {} are {flags:#x} ({}), the image has {:#x}",
                o.mount_point,
                e.options.join(","),
                o.flags
            ));
        }
    }
    None
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

/// Every entry of the tmpfs at `top`, parents first, file contents saved
/// (in content files named `prefix`-N); a directory another mount covers is
/// saved empty.
fn save_tmpfs(d: &Dump<'_>, top: &Path, prefix: &str) -> Result<Tmpfs, String> {
    let md = std::fs::metadata(top).map_err(|e| e.to_string())?;
    let dev = md.dev();
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
                if md.dev() == dev {
                    dirs.push(path.clone());
                }
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
                    &format!("{prefix}-{n}"),
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

/// One mount(2) call: source, target, file system type, flags, data.
struct Call(String, String, String, u64, String);

impl Call {
    fn of(m: &ns::Mount) -> Call {
        Call(
            m.source.into(),
            m.target.into(),
            m.fstype.into(),
            m.flags,
            m.data.clone(),
        )
    }
}

/// Make the mounts of the image's namespace in the new mount namespace of
/// the root stub `root` (before it forks the others), then fill /dev/shm;
/// then the other mounts, in order, each tmpfs filled before the next.
pub fn prepare(r: &mut Restorer<'_>, root: &mut Tracee) -> Result<(), RestoreError> {
    let Some(m) = &r.ck.mounts else {
        return Ok(());
    };
    let mounts = ns::job_mounts(m.proc, m.dev_shm.as_ref().map(|t| t.mode), m.devpts);
    inject_mounts(root, &mounts.iter().map(Call::of).collect::<Vec<_>>())?;
    let in_root = |p: &str| PathBuf::from(format!("/proc/{}/root{p}", root.tid()));
    if let Some(t) = &m.dev_shm {
        fill_tmpfs(r, &in_root(ns::DEV_SHM), t)?;
    }
    if m.devpts {
        // The job's ptys, at their numbers, in its new devpts instance.
        let ptmx = in_root(&format!("{}/ptmx", ns::DEV_PTS));
        crate::kinds::tty::make_ptys(r, &ptmx)?;
    }
    for o in &m.others {
        make_other(r, root, o)?;
    }
    debug!(
        root = root.tid(),
        proc = m.proc,
        devpts = m.devpts,
        others = m.others.len(),
        "mount namespace made"
    );
    Ok(())
}

/// Make the mount `o` in the namespace of the stub `root`.
fn make_other(r: &Restorer<'_>, root: &mut Tracee, o: &Mount) -> Result<(), RestoreError> {
    let at = o.mount_point.clone();
    let none = || "none".to_string();
    // Per-mount flags a bind remount sets (MS_RDONLY last, after a fill).
    let remount = |flags: u64| {
        Call(
            none(),
            at.clone(),
            String::new(),
            libc::MS_BIND | libc::MS_REMOUNT | flags,
            String::new(),
        )
    };
    let mut calls = match &o.kind {
        MountKind::Bind(src) => vec![Call(
            src.clone(),
            at.clone(),
            String::new(),
            libc::MS_BIND,
            String::new(),
        )],
        MountKind::Tmpfs(_) => vec![Call(
            "tmpfs".into(),
            at.clone(),
            "tmpfs".into(),
            o.flags & !libc::MS_RDONLY,
            o.data.clone(),
        )],
        MountKind::Fs(f) => vec![Call(
            f.clone(),
            at.clone(),
            f.clone(),
            o.flags & !libc::MS_RDONLY,
            o.data.clone(),
        )],
    };
    if !matches!(o.kind, MountKind::Tmpfs(_)) {
        calls.push(remount(o.flags));
    }
    calls.push(Call(
        none(),
        at.clone(),
        String::new(),
        match o.propagation {
            Propagation::Shared => libc::MS_SHARED,
            // A slave of what? Its master is outside the new namespace: the
            // mount comes back private (see the warning).
            Propagation::Private | Propagation::Slave => libc::MS_PRIVATE,
        },
        String::new(),
    ));
    if o.propagation == Propagation::Slave {
        warn!(mount_point = %at, "a slave mount comes back private (its master is not in the restored namespace)");
    }
    inject_mounts(root, &calls)?;
    if let MountKind::Tmpfs(t) = &o.kind {
        let top = PathBuf::from(format!("/proc/{}/root{at}", root.tid()));
        fill_tmpfs(r, &top, t)?;
        inject_mounts(root, &[remount(o.flags)])?;
    }
    Ok(())
}

/// Run `mount` for each of `calls` in the stub `t`.
fn inject_mounts(t: &mut Tracee, calls: &[Call]) -> Result<(), RestoreError> {
    let pid = t.tid();
    crate::kinds::tree::restore::inject_with_page(t, |inj, page| {
        for Call(source, target, fstype, flags, data) in calls {
            // source, target, fstype, data: NUL-terminated, one after the other.
            let mut bytes = Vec::new();
            let mut at = Vec::new();
            for s in [source, target, fstype, data] {
                at.push(page + bytes.len() as u64);
                bytes.extend(mem::cstring_bytes(s));
            }
            mem::write_vm(pid, page, &bytes)?;
            let fstype = if fstype.is_empty() { 0 } else { at[2] };
            let data = if data.is_empty() { 0 } else { at[3] };
            inj.call(
                "mount",
                libc::SYS_mount,
                [at[0], at[1], fstype, *flags, data, 0],
            )
            .step(|| format!("cannot mount {source} on {target} for the restored tree"))?;
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
        let what = || format!("cannot restore {}/{}", top.display(), e.path);
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

#[cfg(test)]
mod tests;
