//! Kind "cgroups": the control group of each process in every hierarchy
//! (cgroup v1 hierarchies and the unified v2 one), as /proc/PID/cgroup
//! names them.
//!
//! Capture reads /proc/PID/cgroup. A restore puts each process back into
//! its group, by writing its PID into the group's `cgroup.procs` before
//! its memory is filled (so the memory is charged there), creating the
//! group when it is missing. Where the groups go depends on `--cgroups`
//! ([`CgroupMode`]), hierarchy by hierarchy:
//!
//! - `auto` (the default): the tree's root goes back into its own group
//!   when that group exists here (the same machine, or one set up the same
//!   way); when it does not (the job's group died with its old run, as
//!   under a batch system), the root stays in the restorer's group. Groups
//!   below the root's are made again below wherever the root went; a
//!   process in a group outside the root's subtree goes back to it if it
//!   exists, else with the root.
//! - `here`: the root stays in the restorer's group (a resumed batch job
//!   belongs to its new allocation), the groups below it are made again
//!   under it.
//! - `off`: every process stays in the restorer's groups.
//!
//! The image's section is rewritten to where the processes went before
//! anything is restored ([`place`]), so `--verify` compares with that.
//! A hierarchy the restorer is not in, or that is not mounted here, is
//! left as it is. Threads of one process in different v1 groups come back
//! in the process's group (the main thread's).
//!
//! A v1 cpuset group made by the restore gets its parent's CPUs and memory
//! nodes (a new cpuset is empty and takes no process).

#[cfg(test)]
mod tests;

use crate::capture::Proc;
use crate::error::{CheckpointError, RestoreError, StepContext};
use crate::kinds::Kind;
use crate::restore::Rebuild;
use cr_image::model::{Cgroup, Checkpoint, Process};
use cr_sys::proc::{self, CgroupMount};
use cr_sys::SysError;
use std::path::{Path, PathBuf};
use tracing::{debug, warn};

/// Where a restore puts the processes' control groups (`--cgroups`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum CgroupMode {
    /// Back into the saved groups when the root's group exists here, else
    /// under the restorer's.
    #[default]
    Auto,
    /// The root in the restorer's groups, the groups below it made again
    /// under them.
    Here,
    /// Every process in the restorer's groups.
    Off,
}

pub struct Cgroups;

impl Kind for Cgroups {
    const NAME: &'static str = "cgroups";

    fn capture(cx: &mut Proc<'_, '_>, p: &mut Process) -> Result<(), CheckpointError> {
        let pid = cx.pid;
        p.cgroups = proc::cgroups(pid)
            .map_err(|e| CheckpointError::from_sys(pid, e))?
            .into_iter()
            .map(|(controllers, path)| Cgroup { controllers, path })
            .collect();
        p.cgroups.sort();
        Ok(())
    }

    fn restore(cx: &mut Rebuild<'_, '_>, p: &Process) -> Result<(), RestoreError> {
        let here = cx.r.stash.get::<Here>();
        let pid = cx.stub.pid();
        here.load()?;
        for c in &p.cgroups {
            if here.own(&c.controllers) == Some(c.path.as_str()) {
                continue;
            }
            let Some(m) = here.mount(&c.controllers) else {
                continue;
            };
            let dir = dir_of(m, &c.path).ok_or_else(|| {
                RestoreError::Unsupported(format!(
                    "cgroup {}:{} of process {} is outside the hierarchy's mount at {}",
                    c.controllers,
                    c.path,
                    p.pid,
                    m.mount_point.display()
                ))
            })?;
            make(&dir, m).step(|| format!("cannot create cgroup {}:{}", c.controllers, c.path))?;
            proc::write_string(
                &dir.join("cgroup.procs").display().to_string(),
                &pid.to_string(),
            )
            .step(|| {
                format!(
                    "cannot move process {} into cgroup {}:{}",
                    p.pid, c.controllers, c.path
                )
            })?;
            debug!(pid, hierarchy = %c.controllers, path = %c.path, "process put into its cgroup");
        }
        Ok(())
    }
}

/// The restorer's own groups and the hierarchies' mounts, read once per
/// restore.
#[derive(Default)]
struct Here {
    loaded: bool,
    own: Vec<(String, String)>,
    mounts: Vec<CgroupMount>,
}

impl Here {
    fn load(&mut self) -> Result<(), RestoreError> {
        if !self.loaded {
            self.own = proc::cgroups(std::process::id() as i32)?;
            self.mounts = proc::cgroup_mounts()?;
            self.loaded = true;
        }
        Ok(())
    }

    fn own(&self, controllers: &str) -> Option<&str> {
        self.own
            .iter()
            .find(|(c, _)| c == controllers)
            .map(|(_, p)| p.as_str())
    }

    fn mount(&self, controllers: &str) -> Option<&CgroupMount> {
        self.mounts.iter().find(|m| m.controllers == controllers)
    }
}

/// The directory of group `path` under mount `m` (None: the mount does
/// not show it).
fn dir_of(m: &CgroupMount, path: &str) -> Option<PathBuf> {
    let rel = if m.root == "/" {
        path.strip_prefix('/')?
    } else if path == m.root {
        ""
    } else {
        path.strip_prefix(m.root.as_str())?.strip_prefix('/')?
    };
    Some(m.mount_point.join(rel))
}

/// Create group directory `dir` and the missing ones above it.
fn make(dir: &Path, m: &CgroupMount) -> Result<(), SysError> {
    if dir.is_dir() {
        return Ok(());
    }
    if let Some(parent) = dir.parent() {
        if parent.starts_with(&m.mount_point) && parent != m.mount_point {
            make(parent, m)?;
        }
    }
    let dir_text = dir.display().to_string();
    match std::fs::create_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Ok(()),
        Err(source) => {
            return Err(SysError::Io {
                path: dir_text,
                source,
            })
        }
    }
    if m.controllers.split(',').any(|c| c == "cpuset") {
        // A new v1 cpuset has no CPUs and no memory nodes, and takes no
        // process until it has both.
        let parent = dir.parent().unwrap_or(dir).display().to_string();
        for f in ["cpuset.cpus", "cpuset.mems"] {
            let v = proc::read_string(&format!("{parent}/{f}"))?;
            proc::write_string(&format!("{dir_text}/{f}"), v.trim())?;
        }
    }
    debug!(dir = %dir.display(), "cgroup created");
    Ok(())
}

/// Where a process saved in group `saved` goes (see the module's docs),
/// given the root's saved group `root`, the restorer's own group `own` and
/// whether a group exists here.
pub fn target(
    mode: CgroupMode,
    root: &str,
    saved: &str,
    own: &str,
    exists: impl Fn(&str) -> bool,
) -> String {
    let base = match mode {
        CgroupMode::Off => return own.to_string(),
        CgroupMode::Auto if exists(root) => root,
        _ => own,
    };
    let below = if root == "/" {
        saved.strip_prefix('/')
    } else if saved == root {
        Some("")
    } else {
        saved.strip_prefix(root).and_then(|r| r.strip_prefix('/'))
    };
    match below {
        Some("") => base.to_string(),
        Some(rel) if base == "/" => format!("/{rel}"),
        Some(rel) => format!("{base}/{rel}"),
        None if mode == CgroupMode::Auto && exists(saved) => saved.to_string(),
        None => base.to_string(),
    }
}

/// Rewrite the cgroups section of every process of `ck` to where this
/// restore puts it (see the module's docs): one entry per hierarchy the
/// restorer is in.
pub fn place(ck: &mut Checkpoint, mode: CgroupMode) -> Result<(), RestoreError> {
    let mut here = Here::default();
    here.load()?;
    let root_groups = ck
        .processes
        .iter()
        .find(|p| p.pid == ck.root_pid)
        .map(|p| p.cgroups.clone())
        .unwrap_or_default();
    for p in ck.processes.iter_mut().filter(|p| !p.is_zombie()) {
        let mut placed = Vec::with_capacity(here.own.len());
        for (controllers, own) in &here.own {
            let saved = p.cgroups.iter().find(|c| &c.controllers == controllers);
            let root = root_groups.iter().find(|c| &c.controllers == controllers);
            let path = match (here.mount(controllers), saved, root) {
                (Some(m), Some(saved), Some(root)) => {
                    target(mode, &root.path, &saved.path, own, |g| {
                        dir_of(m, g).is_some_and(|d| d.is_dir())
                    })
                }
                _ => own.clone(),
            };
            placed.push(Cgroup {
                controllers: controllers.clone(),
                path,
            });
        }
        for c in &p.cgroups {
            if !here.own.iter().any(|(h, _)| h == &c.controllers) {
                warn!(
                    pid = p.pid,
                    hierarchy = %c.controllers,
                    path = %c.path,
                    "cgroup hierarchy not mounted here: the process stays out of it"
                );
            }
        }
        placed.sort();
        p.cgroups = placed;
    }
    Ok(())
}

/// `--verify`: the group in every hierarchy.
pub fn verify(c: &mut crate::verify::Compare<'_>, image: &Process, now: &Process) {
    c.same_list("cgroups", "group", &image.cgroups, &now.cgroups);
}
