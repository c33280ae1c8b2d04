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
