//! Section of kind "cgroups": the control group of a process in each
//! hierarchy, as `/proc/PID/cgroup` names them (cgroup v1 hierarchies by
//! their controllers, the unified v2 hierarchy by an empty name).

use super::{pb, Bad};
use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, PartialOrd, Ord)]
pub struct Cgroup {
    /// The hierarchy's controllers as the kernel lists them
    /// ("cpu,cpuacct", "name=systemd"); empty: the unified hierarchy.
    pub controllers: String,
    /// The group from the hierarchy's root, "/" for the root itself.
    pub path: String,
}

impl Cgroup {
    pub(crate) fn to_pb(&self) -> pb::Cgroup {
        pb::Cgroup {
            controllers: self.controllers.clone(),
            path: self.path.clone(),
        }
    }
}

/// A group's path: absolute, no `.` or `..` component, nothing the kernel
/// would not have printed (a restore creates these directories).
fn check_path(p: &str) -> Result<(), Bad> {
    let bad = !p.starts_with('/')
        || p.contains('\0')
        || p.contains('\n')
        || p.split('/').any(|c| c == "." || c == "..");
    if bad {
        return Err(format!("bad cgroup path {p:?}"));
    }
    Ok(())
}

pub(crate) fn from_pb(list: Vec<pb::Cgroup>) -> Result<Vec<Cgroup>, Bad> {
    let mut out = Vec::with_capacity(list.len());
    for c in list {
        check_path(&c.path)?;
        if c.controllers.contains([':', '\n', '\0', '/']) {
            return Err(format!("bad cgroup hierarchy {:?}", c.controllers));
        }
        if out.iter().any(|o: &Cgroup| o.controllers == c.controllers) {
            return Err(format!("cgroup hierarchy {:?} twice", c.controllers));
        }
        out.push(Cgroup {
            controllers: c.controllers,
            path: c.path,
        });
    }
    Ok(out)
}

/// A control group the tree relies on beyond its processes' membership:
/// a group of one of its processes, or one below such a group that no
/// process outside the tree is in (empty groups included), with what a
/// restore that has to make it again writes into it.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct CgroupDir {
    /// The hierarchy, as in [`Cgroup::controllers`].
    pub controllers: String,
    /// The group from the hierarchy's root.
    pub path: String,
    /// The directory's owner and permission bits.
    pub uid: u32,
    pub gid: u32,
    pub mode: u32,
    /// The group's settings, in the order a restore writes them: a
    /// control file's name and its content as read (see the cgroups
    /// kind for which files and how each is written back).
    pub settings: Vec<(String, String)>,
    /// Control files given to another owner (`chown` of `cgroup.procs`
    /// to let a user move processes): name, uid, gid, permission bits.
    pub files: Vec<(String, u32, u32, u32)>,
}

/// A control file's name: one plain name in the group's directory.
fn check_file(name: &str) -> Result<(), Bad> {
    if name.is_empty() || name.contains(['/', '\0']) || name == "." || name == ".." {
        return Err(format!("bad cgroup control file {name:?}"));
    }
    Ok(())
}

impl CgroupDir {
    pub(crate) fn to_pb(&self) -> pb::CgroupDir {
        pb::CgroupDir {
            controllers: self.controllers.clone(),
            path: self.path.clone(),
            uid: self.uid,
            gid: self.gid,
            mode: self.mode,
            settings: self
                .settings
                .iter()
                .map(|(name, value)| pb::CgroupSetting {
                    name: name.clone(),
                    value: value.clone(),
                })
                .collect(),
            files: self
                .files
                .iter()
                .map(|(name, uid, gid, mode)| pb::CgroupFile {
                    name: name.clone(),
                    uid: *uid,
                    gid: *gid,
                    mode: *mode,
                })
                .collect(),
        }
    }

    pub(crate) fn from_pb(d: pb::CgroupDir) -> Result<Self, Bad> {
        check_path(&d.path)?;
        if d.controllers.contains([':', '\n', '\0', '/']) {
            return Err(format!("bad cgroup hierarchy {:?}", d.controllers));
        }
        let at = |what: String| format!("cgroup {}:{}: {what}", d.controllers, d.path);
        let mut settings = Vec::with_capacity(d.settings.len());
        for s in d.settings {
            check_file(&s.name).map_err(at)?;
            if s.value.contains('\0') {
                return Err(at(format!("bad value of {}", s.name)));
            }
            settings.push((s.name, s.value));
        }
        let mut files = Vec::with_capacity(d.files.len());
        for f in d.files {
            check_file(&f.name).map_err(at)?;
            files.push((f.name, f.uid, f.gid, f.mode & 0o7777));
        }
        Ok(CgroupDir {
            controllers: d.controllers,
            path: d.path,
            uid: d.uid,
            gid: d.gid,
            mode: d.mode & 0o7777,
            settings,
            files,
        })
    }
}
