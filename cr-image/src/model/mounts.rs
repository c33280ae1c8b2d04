//! Section of kind "mounts": the mount namespace of a tree that has one of
//! its own (a `cr_run` job): a fresh /proc of its PID namespace, and a
//! private tmpfs on /dev/shm with every file, directory and symbolic link
//! in it (file contents in content files of the image), a devpts instance
//! of its own.

use super::memory::{PageFile, PAGE};
use super::{known_case, pb, ser, Bad};
use serde::Serialize;
use std::collections::HashSet;

/// The longest path or link target accepted.
const MAX_PATH: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct MountNs {
    /// A proc file system of the tree's PID namespace on /proc.
    pub proc: bool,
    /// A private tmpfs on /dev/shm.
    pub dev_shm: Option<Tmpfs>,
    /// A devpts instance of its own on /dev/pts (and /dev/ptmx), where its
    /// ptys are made again.
    pub devpts: bool,
    /// The other mounts made inside the namespace, in the order to make
    /// them.
    pub others: Vec<Mount>,
}

/// A mount made again inside the tree's new mount namespace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Mount {
    /// Where, absolute, as the tree sees it.
    pub mount_point: String,
    pub kind: MountKind,
    /// MS_* flags of the mount (ro, nosuid, nodev, noexec, atime flags).
    pub flags: u64,
    /// The file system's options given at mount.
    pub data: String,
    pub propagation: Propagation,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MountKind {
    /// A bind mount of this path of the restorer's mount namespace.
    Bind(String),
    /// A new tmpfs, with its contents.
    Tmpfs(Tmpfs),
    /// A new instance of proc, sysfs, mqueue or devpts.
    Fs(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Propagation {
    Private,
    Slave,
    Shared,
}

/// The file system types made again as new instances.
pub const NEW_FS_TYPES: [&str; 4] = ["proc", "sysfs", "mqueue", "devpts"];

impl Mount {
    fn from_pb(m: pb::Mount) -> Result<Mount, Bad> {
        let ok = m.mount_point.starts_with('/')
            && m.mount_point.len() <= MAX_PATH
            && !m.mount_point.contains('\0');
        if !ok {
            return Err(format!("bad mount point {:?}", m.mount_point));
        }
        use pb::mount::Kind as K;
        let kind = match known_case(m.kind, &m.mount_point)? {
            K::Bind(s) => {
                if !s.starts_with('/') || s.len() > MAX_PATH || s.contains('\0') {
                    return Err(format!("{}: bad bind source {s:?}", m.mount_point));
                }
                MountKind::Bind(s)
            }
            K::Tmpfs(t) => {
                MountKind::Tmpfs(super::at(Tmpfs::from_pb(t), || m.mount_point.clone())?)
            }
            K::Fstype(f) => {
                if !NEW_FS_TYPES.contains(&f.as_str()) {
                    return Err(format!("{}: unknown file system type {f:?}", m.mount_point));
                }
                MountKind::Fs(f)
            }
        };
        let propagation = match m.propagation {
            0 => Propagation::Private,
            1 => Propagation::Slave,
            2 => Propagation::Shared,
            n => return Err(format!("{}: bad propagation {n}", m.mount_point)),
        };
        if m.data.contains('\0') || m.data.len() > MAX_PATH {
            return Err(format!("{}: bad options", m.mount_point));
        }
        Ok(Mount {
            mount_point: m.mount_point,
            kind,
            flags: m.flags,
            data: m.data,
            propagation,
        })
    }

    fn to_pb(&self) -> pb::Mount {
        use pb::mount::Kind as K;
        pb::Mount {
            mount_point: self.mount_point.clone(),
            kind: Some(match &self.kind {
                MountKind::Bind(s) => K::Bind(s.clone()),
                MountKind::Tmpfs(t) => K::Tmpfs(t.to_pb()),
                MountKind::Fs(f) => K::Fstype(f.clone()),
            }),
            flags: self.flags,
            data: self.data.clone(),
            propagation: match self.propagation {
                Propagation::Private => 0,
                Propagation::Slave => 1,
                Propagation::Shared => 2,
            },
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Tmpfs {
    /// Mode of its root directory.
    #[serde(serialize_with = "ser::octal")]
    pub mode: u32,
    /// Parents before children.
    pub entries: Vec<TmpfsEntry>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TmpfsEntry {
    /// Relative to the mount point.
    pub path: String,
    #[serde(serialize_with = "ser::octal")]
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime_ns: i64,
    #[serde(flatten)]
    pub kind: TmpfsKind,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TmpfsKind {
    Dir,
    File {
        size: u64,
        content: Option<PageFile>,
    },
    Symlink {
        target: String,
    },
}

impl MountNs {
    /// The content files of its tmpfs files.
    pub fn content_files(&self) -> impl Iterator<Item = &PageFile> {
        self.dev_shm
            .iter()
            .chain(self.others.iter().filter_map(|m| match &m.kind {
                MountKind::Tmpfs(t) => Some(t),
                _ => None,
            }))
            .flat_map(|t| t.entries.iter())
            .filter_map(|e| match &e.kind {
                TmpfsKind::File { content, .. } => content.as_ref(),
                _ => None,
            })
    }

    pub(crate) fn from_pb(m: pb::MountNs) -> Result<MountNs, Bad> {
        Ok(MountNs {
            proc: m.proc,
            dev_shm: m
                .dev_shm
                .map(|t| super::at(Tmpfs::from_pb(t), || "its /dev/shm".into()))
                .transpose()?,
            devpts: m.devpts,
            others: m
                .others
                .into_iter()
                .map(Mount::from_pb)
                .collect::<Result<_, _>>()?,
        })
    }

    pub(crate) fn to_pb(&self) -> pb::MountNs {
        pb::MountNs {
            proc: self.proc,
            dev_shm: self.dev_shm.as_ref().map(Tmpfs::to_pb),
            devpts: self.devpts,
            others: self.others.iter().map(Mount::to_pb).collect(),
        }
    }
}

/// A path of the tmpfs: relative, no empty, `.` or `..` component.
fn check_path(p: &str) -> Result<(), Bad> {
    let ok = !p.is_empty()
        && p.len() <= MAX_PATH
        && !p.contains('\0')
        && p.split('/').all(|c| !c.is_empty() && c != "." && c != "..");
    if !ok {
        return Err(format!("bad path {p:?}"));
    }
    Ok(())
}

impl Tmpfs {
    fn from_pb(t: pb::Tmpfs) -> Result<Tmpfs, Bad> {
        let mut dirs: HashSet<String> = HashSet::new();
        let mut seen: HashSet<String> = HashSet::new();
        let mut entries = Vec::with_capacity(t.entries.len());
        for e in t.entries {
            check_path(&e.path)?;
            if let Some((parent, _)) = e.path.rsplit_once('/') {
                if !dirs.contains(parent) {
                    return Err(format!("{}: its directory is not listed before it", e.path));
                }
            }
            if !seen.insert(e.path.clone()) {
                return Err(format!("{} is listed twice", e.path));
            }
            use pb::tmpfs_entry::Kind as K;
            let kind = match known_case(e.kind, &e.path)? {
                K::Dir(_) => {
                    dirs.insert(e.path.clone());
                    TmpfsKind::Dir
                }
                K::File(f) => {
                    let content = f.content.map(PageFile::from_pb).transpose()?;
                    let room = f.size.div_ceil(PAGE) * PAGE;
                    if content
                        .as_ref()
                        .is_some_and(|c| c.extents.iter().any(|x| x.file_offset + x.len() > room))
                    {
                        return Err(format!("{}: content beyond its size", e.path));
                    }
                    TmpfsKind::File {
                        size: f.size,
                        content,
                    }
                }
                K::Symlink(target) => {
                    if target.is_empty() || target.len() > MAX_PATH || target.contains('\0') {
                        return Err(format!("{}: bad link target", e.path));
                    }
                    TmpfsKind::Symlink { target }
                }
            };
            entries.push(TmpfsEntry {
                path: e.path,
                mode: e.mode & 0o7777,
                uid: e.uid,
                gid: e.gid,
                mtime_ns: e.mtime_ns,
                kind,
            });
        }
        Ok(Tmpfs {
            mode: t.mode & 0o7777,
            entries,
        })
    }

    fn to_pb(&self) -> pb::Tmpfs {
        use pb::tmpfs_entry::Kind as K;
        pb::Tmpfs {
            mode: self.mode,
            entries: self
                .entries
                .iter()
                .map(|e| pb::TmpfsEntry {
                    path: e.path.clone(),
                    mode: e.mode,
                    uid: e.uid,
                    gid: e.gid,
                    mtime_ns: e.mtime_ns,
                    kind: Some(match &e.kind {
                        TmpfsKind::Dir => K::Dir(pb::Empty {}),
                        TmpfsKind::File { size, content } => K::File(pb::TmpfsFile {
                            size: *size,
                            content: content.as_ref().map(PageFile::to_pb),
                        }),
                        TmpfsKind::Symlink { target } => K::Symlink(target.clone()),
                    }),
                })
                .collect(),
        }
    }
}
