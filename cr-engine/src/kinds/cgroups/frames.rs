//! `--cgroup-root [CONTROLLERS:]PATH` (CRIU's option of that name): the
//! job's frame in a hierarchy, the part of its groups' paths that belongs
//! to where it runs rather than to the job.
//!
//! At a checkpoint it names, per hierarchy, a group at or above the root
//! process's own: the job's groups are that frame plus a path below it
//! (saved as `Checkpoint::cgroup_frames`; a hierarchy not named has the
//! root process's group as its frame). At a restore it names the group
//! that replaces the frame: every group below the frame goes to the same
//! path below the new root, which the restore makes if missing. Without
//! CONTROLLERS an argument applies to every hierarchy not named by
//! another; CONTROLLERS match a hierarchy holding all of them ("memory",
//! "cpu" for "cpu,cpuacct", "name=systemd").

use crate::error::CheckpointError;
use cr_image::model::{Cgroup, Process};

/// One `--cgroup-root` argument.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupRoot {
    /// The controllers it names (None: every hierarchy not named).
    pub controllers: Option<String>,
    /// The group, from the hierarchy's root.
    pub path: String,
}

impl std::str::FromStr for CgroupRoot {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (controllers, path) = match s.find('/') {
            Some(0) => (None, s),
            Some(i) if s[..i].ends_with(':') && i > 1 => (Some(s[..i - 1].to_string()), &s[i..]),
            _ => return Err(format!("{s:?}: want [CONTROLLERS:]/PATH")),
        };
        if path.split('/').any(|c| c == "..") {
            return Err(format!("{s:?}: the path may not climb (\"..\")"));
        }
        let path = path.trim_end_matches('/');
        Ok(CgroupRoot {
            controllers,
            path: if path.is_empty() { "/" } else { path }.to_string(),
        })
    }
}

/// The argument of `roots` that applies to hierarchy `controllers`: the
/// one naming it, else the one naming none.
pub fn for_hierarchy<'a>(roots: &'a [CgroupRoot], controllers: &str) -> Option<&'a CgroupRoot> {
    let has = |want: &str| {
        let mine: Vec<&str> = controllers.split(',').collect();
        want.split(',').all(|w| mine.contains(&w))
    };
    roots
        .iter()
        .find(|r| {
            r.controllers
                .as_deref()
                .is_some_and(|c| !controllers.is_empty() && has(c))
        })
        .or_else(|| roots.iter().find(|r| r.controllers.is_none()))
}

/// Whether group `g` is `frame` or below it.
pub fn within(frame: &str, g: &str) -> bool {
    frame == "/" || g == frame || g.strip_prefix(frame).is_some_and(|r| r.starts_with('/'))
}

/// The frames a checkpoint's `--cgroup-root` arguments name for the tree
/// whose root is `root` (its groups captured): one per hierarchy an
/// argument applies to, each at or above the root's group, else refused.
pub fn capture(roots: &[CgroupRoot], root: &Process) -> Result<Vec<Cgroup>, CheckpointError> {
    let mut frames = Vec::new();
    for c in &root.cgroups {
        let Some(r) = for_hierarchy(roots, &c.controllers) else {
            continue;
        };
        if !within(&r.path, &c.path) {
            let hierarchy = if c.controllers.is_empty() {
                "the unified hierarchy"
            } else {
                c.controllers.as_str()
            };
            return Err(CheckpointError::Invalid(format!(
                "--cgroup-root {}: the root process {} is in {} of {hierarchy}, not at or below it",
                r.path, root.pid, c.path
            )));
        }
        frames.push(Cgroup {
            controllers: c.controllers.clone(),
            path: r.path.clone(),
        });
    }
    Ok(frames)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root(s: &str) -> CgroupRoot {
        s.parse().unwrap()
    }

    #[test]
    fn arguments_parse_and_match_their_hierarchies() {
        assert_eq!(
            root("name=zdtmtst:/prefix/"),
            CgroupRoot {
                controllers: Some("name=zdtmtst".into()),
                path: "/prefix".into()
            }
        );
        assert_eq!(root("/").path, "/");
        assert!("prefix".parse::<CgroupRoot>().is_err());
        assert!("memory:prefix".parse::<CgroupRoot>().is_err());
        assert!("/a/../b".parse::<CgroupRoot>().is_err());
        let all = [root("cpu:/c"), root("/d"), root("name=x:/x")];
        assert_eq!(for_hierarchy(&all, "cpu,cpuacct").unwrap().path, "/c");
        assert_eq!(for_hierarchy(&all, "memory").unwrap().path, "/d");
        assert_eq!(for_hierarchy(&all, "").unwrap().path, "/d");
        assert_eq!(for_hierarchy(&all, "name=x").unwrap().path, "/x");
        assert!(for_hierarchy(&all[..1], "memory").is_none());
        assert!(within("/a", "/a/b") && within("/a", "/a") && within("/", "/z"));
        assert!(!within("/a", "/ab"));
    }
}
