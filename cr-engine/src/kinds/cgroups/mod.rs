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
//!   way), or when it is missing but below the restorer's own group (or
//!   the restorer is at the hierarchy's root): the restore makes it again,
//!   as the restorer could have. When it is missing elsewhere (the job's
//!   group died with its old run, as under a batch system), the root stays
//!   in the restorer's group. Groups below the root's are made again below
//!   wherever the root went; a process in a group outside the root's
//!   subtree goes back to it if it exists or could be made, else with the
//!   root.
//! - `here`: the root stays in the restorer's group (a resumed batch job
//!   belongs to its new allocation), the groups below it are made again
//!   under it.
//! - `off`: every process stays in the restorer's groups.
//!
//! The image's section is rewritten to where the processes went before
//! anything is restored ([`place`]), so `--verify` compares with that.
//! A hierarchy the restorer is not in, or that is not mounted here, is
//! left as it is. A thread in other groups than its process's (v1 moves
//! threads one by one; v2 threaded groups) has them in the image, and is
//! moved back into them once made ([`put_thread`]).
//!
//! A v1 cpuset group made by the restore gets its parent's CPUs and memory
//! nodes (a new cpuset is empty and takes no process).
//!
//! Besides each process's membership the image holds the groups the tree
//! relies on ([`dirs`]): the processes' groups and the groups below them
//! that no process outside the tree is in, empty ones too, with their
//! owner, mode, control files given to other owners and settings (limits,
//! weights, cpusets...). A restore makes those that are missing, where
//! `--cgroups` places them, and writes their settings and owners back
//! into the groups it made (a group that exists keeps its own). A restore
//! that fails removes the groups it made ([`Leftovers`]).
//!
//! A tree in a cgroup namespace of its own (`unshare -C`) sees its groups
//! relative to the namespace's root, the groups its creator was in when it
//! unshared. Capture reads /proc/PID/cgroup once more from a thread that
//! joined the namespace ([`capture_ns`]): the difference is that root.
//! The restore maps the root like any group ([`place`]), moves the root's
//! stub there and has it unshare a new namespace before it forks the others
//! ([`enter_ns`]); then each process goes into its own group as usual.

pub mod dirs;
pub mod frames;
mod leftovers;
#[cfg(test)]
mod tests;

pub use leftovers::Leftovers;

use crate::capture::Proc;
use crate::error::{CheckpointError, RestoreError, StepContext};
use crate::kinds::Kind;
use crate::restore::Rebuild;
use cr_image::model::{Cgroup, Checkpoint, Process};
use cr_sys::proc::{self, CgroupMount};
use cr_sys::ptrace::Tracee;
use cr_sys::SysError;
use std::path::{Path, PathBuf};
use tracing::{debug, warn};

/// Where a restore puts the processes' control groups (`--cgroups`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum CgroupMode {
    /// Back into the saved groups when the root's group exists here, else
    /// under the restorer's. (CRIU's `--manage-cgroups` modes that restore
    /// membership are accepted for it.)
    #[default]
    #[value(
        alias = "soft",
        alias = "full",
        alias = "strict",
        alias = "props",
        alias = "none"
    )]
    Auto,
    /// The root in the restorer's groups, the groups below it made again
    /// under them.
    Here,
    /// Every process in the restorer's groups (CRIU's "ignore").
    #[value(alias = "ignore")]
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
        // Threads in groups of their own (the threads kind ran before).
        for th in p.threads.iter_mut().skip(1) {
            let list = proc::task_cgroups(pid, th.tid as i32)
                .map_err(|e| CheckpointError::from_sys(pid, e))?;
            th.cgroups = list
                .into_iter()
                .map(|(controllers, path)| Cgroup { controllers, path })
                .filter(|c| !p.cgroups.contains(c))
                .collect();
            th.cgroups.sort();
        }
        Ok(())
    }

    fn restore(cx: &mut Rebuild<'_, '_, '_>, p: &Process) -> Result<(), RestoreError> {
        // In a namespace of its own the root's stub left the restorer's
        // groups (for the namespace's root): every group is written.
        let own_ns = cx.r.ck.cgroupns.is_some();
        let here = cx.r.stash.get::<Here>();
        here.load()?;
        for c in &p.cgroups {
            if !own_ns && here.own(&c.controllers) == Some(c.path.as_str()) {
                continue;
            }
            put(here, cx.stub.pid(), p.pid, c)?;
        }
        Ok(())
    }
}

/// Put thread `tid`, made for thread `th` of the image, into the groups
/// it had apart from its process (placed already, see [`place`]): its TID
/// into the v1 group's `tasks`, or the v2 threaded group's
/// `cgroup.threads`.
pub fn put_thread(
    cx: &mut Rebuild<'_, '_, '_>,
    tid: i32,
    th: &cr_image::model::Thread,
) -> Result<(), RestoreError> {
    if th.cgroups.is_empty() {
        return Ok(());
    }
    let here = cx.r.stash.get::<Here>();
    here.load()?;
    for c in &th.cgroups {
        let Some(m) = here.mount(&c.controllers) else {
            continue;
        };
        let Some(dir) = dir_of(m, &c.path) else {
            continue;
        };
        let file = if c.controllers.is_empty() {
            "cgroup.threads"
        } else {
            "tasks"
        };
        enter(m, &dir, c, file, tid, &format!("thread {}", th.tid))?;
    }
    Ok(())
}

/// Put stub `pid` (process `saved` of the image) into group `c`, made if
/// missing; a hierarchy not mounted here is left alone.
fn put(here: &Here, pid: i32, saved: u32, c: &Cgroup) -> Result<(), RestoreError> {
    let Some(m) = here.mount(&c.controllers) else {
        return Ok(());
    };
    let dir = dir_of(m, &c.path).ok_or_else(|| {
        RestoreError::Unsupported(format!(
            "cgroup {}:{} of process {saved} is outside the hierarchy's mount at {}",
            c.controllers,
            c.path,
            m.mount_point.display()
        ))
    })?;
    enter(m, &dir, c, "cgroup.procs", pid, &format!("process {saved}"))?;
    debug!(pid, hierarchy = %c.controllers, path = %c.path, "process put into its cgroup");
    Ok(())
}

/// Make group `c` at `dir` (of mount `m`) if it is missing, and move `id`
/// (named `who` in an error) into it by writing it to its `file`
/// (`cgroup.procs`, or `tasks`/`cgroup.threads` for a thread).
fn enter(
    m: &CgroupMount,
    dir: &Path,
    c: &Cgroup,
    file: &str,
    id: i32,
    who: &str,
) -> Result<(), RestoreError> {
    make(dir, m).step(|| format!("cannot create cgroup {}:{}", c.controllers, c.path))?;
    proc::write_string(&dir.join(file).display().to_string(), &id.to_string())
        .step(|| format!("cannot move {who} into cgroup {}:{}", c.controllers, c.path))
}

/// The root of the cgroup namespace of the tree `images` (root first) in
/// each hierarchy, as we see the groups; None when the tree shares ours.
/// Every live process of the tree must be in the root's namespace.
pub fn capture_ns(images: &[Process]) -> Result<Option<Vec<Cgroup>>, CheckpointError> {
    let Some(root) = images.first().map(|p| p.pid as i32) else {
        return Ok(None);
    };
    let sys = |e| CheckpointError::from_sys(root, e);
    if !cr_sys::ns::differs(root, "cgroup").map_err(sys)? {
        return Ok(None);
    }
    crate::kinds::tree::same_namespace(images, "cgroup", "a cgroup")?;
    let roots = ns_roots(root).map_err(|why| CheckpointError::unsupported(root, why))?;
    debug!(root, ?roots, "cgroup namespace saved");
    Ok(Some(roots))
}

/// The root of process `pid`'s cgroup namespace in each hierarchy: its
/// group as we see it, less the part its namespace shows.
fn ns_roots(pid: i32) -> Result<Vec<Cgroup>, String> {
    let outside = proc::cgroups(pid).map_err(|e| cr_sys::error::one_line(&e))?;
    let inside = cr_sys::ns::cgroups_seen_by(pid).map_err(|e| cr_sys::error::one_line(&e))?;
    let mut roots = Vec::with_capacity(outside.len());
    for (controllers, full) in outside {
        let rel = inside
            .iter()
            .find(|(c, _)| *c == controllers)
            .map(|(_, r)| r.as_str())
            .unwrap_or("/");
        let root = ns_root(&full, rel).ok_or_else(|| {
            format!(
                "a cgroup namespace whose root is not above the process's group \
                 {controllers}:{full} (it shows {rel})"
            )
        })?;
        roots.push(Cgroup {
            controllers,
            path: root,
        });
    }
    roots.sort();
    Ok(roots)
}

/// The namespace root of a group that is `full` from the hierarchy's root
/// and `rel` from the namespace's; None when `rel` climbs above the
/// namespace ("/../x": the process moved out of it).
fn ns_root(full: &str, rel: &str) -> Option<String> {
    if rel == "/" {
        return Some(full.to_string());
    }
    if rel.split('/').any(|c| c == "..") {
        return None;
    }
    let root = full.strip_suffix(rel)?;
    Some(if root.is_empty() {
        "/".into()
    } else {
        root.into()
    })
}

/// Move the root's stub `root` (before it forks the others) into the roots
/// of the image's cgroup namespace and have it unshare a new one there.
pub fn enter_ns(ck: &Checkpoint, root: &mut Tracee) -> Result<(), RestoreError> {
    let Some(roots) = &ck.cgroupns else {
        return Ok(());
    };
    let mut here = Here::default();
    here.load()?;
    for c in roots {
        put(&here, root.tid(), ck.root_pid, c)?;
    }
    crate::kinds::tree::restore::inject_once(
        root,
        "unshare",
        libc::SYS_unshare,
        [libc::CLONE_NEWCGROUP as u64, 0, 0, 0, 0, 0],
    )?;
    debug!(root = root.tid(), ?roots, "cgroup namespace made");
    Ok(())
}

/// `--verify`: the tree whose root is `pid` now has the image's cgroup
/// namespace (a difference named, or None).
pub fn verify_ns(ck: &Checkpoint, pid: i32) -> Option<String> {
    let now = match cr_sys::ns::differs(pid, "cgroup") {
        Ok(false) => None,
        Ok(true) => match ns_roots(pid) {
            Ok(r) => Some(r),
            Err(why) => return Some(format!("cgroup namespace: {why}")),
        },
        Err(e) => return Some(format!("cgroup namespace: {}", cr_sys::error::one_line(&e))),
    };
    (now != ck.cgroupns).then(|| {
        format!(
            "cgroup namespace: roots {:?} in the image, {:?} now",
            ck.cgroupns, now
        )
    })
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
    to: Option<&str>,
    exists: impl Fn(&str) -> bool,
) -> String {
    // A missing group below the restorer's own (or any, when the restorer
    // is at the hierarchy's root) is one the restorer could have made
    // itself: made again where it was. One elsewhere died with the tree's
    // old run (a batch job's group).
    let again = |g: &str| {
        exists(g)
            || own == "/"
            || g == own
            || g.strip_prefix(own).is_some_and(|r| r.starts_with('/'))
    };
    let base = match (mode, to) {
        (CgroupMode::Off, _) => return own.to_string(),
        (_, Some(to)) => to,
        (CgroupMode::Auto, None) if again(root) => root,
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
        None if to.is_some() || (mode == CgroupMode::Auto && again(saved)) => saved.to_string(),
        None => base.to_string(),
    }
}

/// Rewrite the cgroups section of every process of `ck` to where this
/// restore puts it (see the module's docs): one entry per hierarchy the
/// restorer is in.
pub fn place(
    ck: &mut Checkpoint,
    mode: CgroupMode,
    roots: &[frames::CgroupRoot],
) -> Result<(), RestoreError> {
    let mut here = Here::default();
    here.load()?;
    // The job's frame in each hierarchy: the root's group, or the one
    // `cr_checkpoint --cgroup-root` named.
    let mut root_groups = ck
        .processes
        .iter()
        .find(|p| p.pid == ck.root_pid)
        .map(|p| p.cgroups.clone())
        .unwrap_or_default();
    for g in root_groups.iter_mut() {
        if let Some(f) = ck
            .cgroup_frames
            .iter()
            .find(|f| f.controllers == g.controllers)
        {
            g.path = f.path.clone();
        }
    }
    let root_groups = Frames {
        of: root_groups,
        roots,
    };
    for p in ck.processes.iter_mut().filter(|p| !p.is_zombie()) {
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
        p.cgroups = placed(&here, mode, &root_groups, &p.cgroups);
        // A thread's own groups: where they go, unless that is where its
        // process goes (or nowhere: a hierarchy not mounted here).
        for th in p.threads.iter_mut().skip(1) {
            let own = placed(&here, mode, &root_groups, &th.cgroups);
            th.cgroups = own
                .into_iter()
                .filter(|c| {
                    th.cgroups.iter().any(|s| s.controllers == c.controllers)
                        && !p.cgroups.contains(c)
                })
                .collect();
        }
    }
    // The namespace's roots go where their groups go.
    if let Some(roots) = ck.cgroupns.take() {
        ck.cgroupns = Some(placed(&here, mode, &root_groups, &roots));
    }
    // The groups the tree relies on go where the processes' groups go;
    // one outside the root's subtree that cannot go back is not made.
    let mut seen = std::collections::HashSet::new();
    for mut d in std::mem::take(&mut ck.cgroup_dirs) {
        let (Some(own), Some(m), Some(root)) = (
            here.own(&d.controllers),
            here.mount(&d.controllers),
            root_groups
                .of
                .iter()
                .find(|c| c.controllers == d.controllers),
        ) else {
            continue;
        };
        if mode == CgroupMode::Off {
            continue;
        }
        let to = target(
            mode,
            &root.path,
            &d.path,
            own,
            root_groups.to(&d.controllers),
            |g| dir_of(m, g).is_some_and(|d| d.is_dir()),
        );
        let under_root = root.path == "/"
            || d.path == root.path
            || d.path
                .strip_prefix(root.path.as_str())
                .is_some_and(|r| r.starts_with('/'));
        if (under_root || to == d.path) && seen.insert((d.controllers.clone(), to.clone())) {
            d.path = to;
            ck.cgroup_dirs.push(d);
        }
    }
    Ok(())
}

/// The job's frame in each hierarchy (see [`frames`]) and the restore's
/// `--cgroup-root` arguments.
struct Frames<'a> {
    of: Vec<Cgroup>,
    roots: &'a [frames::CgroupRoot],
}

impl Frames<'_> {
    /// The group that replaces the frame of hierarchy `controllers`.
    fn to(&self, controllers: &str) -> Option<&str> {
        frames::for_hierarchy(self.roots, controllers).map(|r| r.path.as_str())
    }
}

/// Where groups `saved` (one per hierarchy) go, given the job's frames:
/// one entry per hierarchy the restorer is in, sorted.
fn placed(here: &Here, mode: CgroupMode, frames: &Frames<'_>, saved: &[Cgroup]) -> Vec<Cgroup> {
    let mut out = Vec::with_capacity(here.own.len());
    for (controllers, own) in &here.own {
        let saved = saved.iter().find(|c| &c.controllers == controllers);
        let root = frames.of.iter().find(|c| &c.controllers == controllers);
        let path = match (here.mount(controllers), saved, root) {
            (Some(m), Some(saved), Some(root)) => target(
                mode,
                &root.path,
                &saved.path,
                own,
                frames.to(controllers),
                |g| dir_of(m, g).is_some_and(|d| d.is_dir()),
            ),
            _ => own.clone(),
        };
        out.push(Cgroup {
            controllers: controllers.clone(),
            path,
        });
    }
    out.sort();
    out
}

/// `--verify`: the group in every hierarchy, and each thread's own.
pub fn verify(c: &mut crate::verify::Compare<'_>, image: &Process, now: &Process) {
    c.same_list("cgroups", "group", &image.cgroups, &now.cgroups);
    for (a, b) in image.threads.iter().zip(&now.threads).skip(1) {
        c.same_list("cgroups", "thread's own group", &a.cgroups, &b.cgroups);
    }
}
