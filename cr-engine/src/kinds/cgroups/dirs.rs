//! The control groups a tree relies on beyond its processes' membership
//! ([`CgroupDir`]): each process's group and the groups below it that no
//! process outside the tree is in, empty ones included (a program that
//! made `work/a` and `work/b` for later finds them again), with their
//! owner and mode, the control files given to another owner (a group
//! delegated to a user), and their settings.
//!
//! Capture reads them before the tree is frozen ([`capture`]): groups are
//! made and set up by whoever manages them, and the freeze stays short; a
//! walk
//! below a group stops at a group holding a process outside the tree (it
//! is someone else's) and at [`MAX_DIRS`] groups. The hierarchy's root
//! group is never walked: everything on the machine is below it.
//!
//! A restore makes the missing ones, parents first, where `--cgroups`
//! places them, and writes into each group it made its owner, mode and
//! settings ([`make`]). A group that exists keeps its own settings: it
//! belongs to whoever made it. Only the control files of [`SETTINGS`] are
//! ever written, whatever an image says. A setting the kernel refuses
//! here fails the restore when it bounds the tree (memory, pids, CPU
//! bandwidth, devices), and is a warning otherwise (a cpuset naming CPUs
//! this machine lacks, real-time runtime the parent does not have).
//!
//! Control groups made by a restore that then fails are left, empty.

use super::{dir_of, CgroupMount, Here};
use crate::error::{RestoreError, StepContext};
use cr_image::model::{CgroupDir, Checkpoint};
use cr_sys::proc;
use std::collections::{BTreeSet, HashSet};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use tracing::{debug, warn};

/// Most groups an image holds (a walk below the processes' groups stops
/// there, with a warning).
pub const MAX_DIRS: usize = 512;

/// How a control file's content, as read, is written back.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Write {
    /// As read, in one write.
    Plain,
    /// Each line in a write of its own (`net_prio.ifpriomap`, `io.weight`).
    Lines,
    /// `memory.oom_control` reads "oom_kill_disable N\n..." and takes N.
    OomControl,
    /// `devices.list`: "a" into `devices.deny`, then each line into
    /// `devices.allow` (unless it allows everything, as a new group does).
    Devices,
    /// `cgroup.subtree_control` reads "cpu memory" and takes "+cpu +memory".
    Subtree,
    /// `cgroup.type`: only "threaded" is written (a new group is a domain).
    Type,
}

/// The control files saved and written back, in the order they are
/// written: a v1 cpuset first (its group takes no process without CPUs
/// and memory nodes), a CPU period before its quota, v2's subtree control
/// before the groups below are made. `true`: a refusal fails the restore.
const SETTINGS: &[(&str, Write, bool)] = &[
    ("cgroup.type", Write::Type, true),
    ("cgroup.clone_children", Write::Plain, false),
    ("notify_on_release", Write::Plain, false),
    ("cpuset.cpus", Write::Plain, false),
    ("cpuset.mems", Write::Plain, false),
    ("cpuset.cpu_exclusive", Write::Plain, false),
    ("cpuset.mem_exclusive", Write::Plain, false),
    ("cpuset.mem_hardwall", Write::Plain, false),
    ("cpuset.memory_migrate", Write::Plain, false),
    ("cpuset.memory_spread_page", Write::Plain, false),
    ("cpuset.memory_spread_slab", Write::Plain, false),
    ("cpuset.sched_load_balance", Write::Plain, false),
    ("cpuset.sched_relax_domain_level", Write::Plain, false),
    ("cpuset.cpus.partition", Write::Plain, false),
    ("cpu.shares", Write::Plain, false),
    ("cpu.cfs_period_us", Write::Plain, true),
    ("cpu.cfs_quota_us", Write::Plain, true),
    ("cpu.rt_period_us", Write::Plain, false),
    ("cpu.rt_runtime_us", Write::Plain, false),
    ("cpu.weight", Write::Plain, false),
    ("cpu.max", Write::Plain, true),
    ("cpu.idle", Write::Plain, false),
    ("cpu.uclamp.min", Write::Plain, false),
    ("cpu.uclamp.max", Write::Plain, false),
    ("memory.use_hierarchy", Write::Plain, false),
    ("memory.limit_in_bytes", Write::Plain, true),
    ("memory.memsw.limit_in_bytes", Write::Plain, false),
    ("memory.soft_limit_in_bytes", Write::Plain, false),
    ("memory.swappiness", Write::Plain, false),
    ("memory.move_charge_at_immigrate", Write::Plain, false),
    ("memory.oom_control", Write::OomControl, false),
    ("memory.min", Write::Plain, false),
    ("memory.low", Write::Plain, false),
    ("memory.high", Write::Plain, true),
    ("memory.max", Write::Plain, true),
    ("memory.swap.max", Write::Plain, true),
    ("memory.oom.group", Write::Plain, false),
    ("pids.max", Write::Plain, true),
    ("blkio.weight", Write::Plain, false),
    ("io.weight", Write::Lines, false),
    ("net_cls.classid", Write::Plain, false),
    ("net_prio.ifpriomap", Write::Lines, false),
    ("devices.list", Write::Devices, true),
    ("cgroup.subtree_control", Write::Subtree, true),
];

/// The groups the tree of processes `pids` (as we see them) relies on,
/// parents first, from the groups its processes and threads are in now:
/// read before the freeze (0.3 ms for one memory group on the machine
/// this was written on). Best effort: a group that cannot be read is left
/// out with a warning (the processes' membership is saved apart).
pub fn capture(pids: &[i32]) -> Vec<CgroupDir> {
    let t0 = std::time::Instant::now();
    let mounts = match proc::cgroup_mounts() {
        Ok(m) => m,
        Err(e) => {
            warn!("cgroup mounts unreadable, no group saved beyond membership: {e}");
            return Vec::new();
        }
    };
    let mut groups: BTreeSet<(String, String)> = BTreeSet::new();
    for &pid in pids {
        let tids = proc::tasks(pid).unwrap_or_else(|_| vec![pid]);
        for tid in tids {
            // Gone meanwhile, or a zombie: nothing of its own to keep.
            for g in proc::task_cgroups(pid, tid).unwrap_or_default() {
                if g.1 != "/" {
                    groups.insert(g);
                }
            }
        }
    }
    let mut walk = Walk {
        tree: pids.iter().copied().collect(),
        seen: HashSet::new(),
        out: Vec::new(),
        full: false,
    };
    for (controllers, path) in &groups {
        let Some(m) = mounts.iter().find(|m| &m.controllers == controllers) else {
            continue;
        };
        walk.group(m, path);
    }
    let mut out = walk.out;
    // A parent's path is a prefix of its children's: sorted, it comes first.
    out.sort_by(|a, b| (&a.controllers, &a.path).cmp(&(&b.controllers, &b.path)));
    debug!(
        groups = out.len(),
        us = t0.elapsed().as_micros() as u64,
        "control groups the tree relies on read"
    );
    out
}

struct Walk {
    tree: HashSet<i32>,
    seen: HashSet<(String, String)>,
    out: Vec<CgroupDir>,
    full: bool,
}

impl Walk {
    /// Group `path` of the hierarchy mounted at `m`, and the groups below.
    fn group(&mut self, m: &CgroupMount, path: &str) {
        if !self.seen.insert((m.controllers.clone(), path.to_string())) {
            return;
        }
        if self.out.len() >= MAX_DIRS {
            if !self.full {
                warn!(
                    hierarchy = %m.controllers,
                    path,
                    "more than {MAX_DIRS} control groups below the tree's: the others are not saved"
                );
                self.full = true;
            }
            return;
        }
        let Some(dir) = dir_of(m, path) else {
            return;
        };
        let entries = match std::fs::read_dir(&dir) {
            Ok(rd) => rd.filter_map(|e| e.ok()).collect::<Vec<_>>(),
            Err(e) => {
                warn!(hierarchy = %m.controllers, path, "control group unreadable, not saved: {e}");
                return;
            }
        };
        let Ok(md) = std::fs::metadata(&dir) else {
            return;
        };
        let mut d = CgroupDir {
            controllers: m.controllers.clone(),
            path: path.to_string(),
            uid: md.uid(),
            gid: md.gid(),
            mode: md.mode() & 0o7777,
            settings: Vec::new(),
            files: Vec::new(),
        };
        let mut subs = Vec::new();
        let mut names = HashSet::new();
        for e in &entries {
            let Some(name) = e.file_name().to_str().map(str::to_string) else {
                continue;
            };
            let Ok(kind) = e.file_type() else {
                continue;
            };
            if kind.is_dir() {
                if !name.contains('\n') {
                    subs.push(name);
                }
                continue;
            }
            if let Ok(md) = e.metadata() {
                if md.uid() != 0 || md.gid() != 0 {
                    d.files
                        .push((name.clone(), md.uid(), md.gid(), md.mode() & 0o7777));
                }
            }
            names.insert(name);
        }
        d.files.sort();
        for (name, _, _) in SETTINGS.iter().filter(|(n, _, _)| names.contains(*n)) {
            // Write-only or unreadable here: not saved.
            if let Ok(v) = proc::read_string(&dir.join(name).display().to_string()) {
                d.settings
                    .push((name.to_string(), v.trim_end().to_string()));
            }
        }
        self.out.push(d);
        subs.sort();
        for name in subs {
            let sub = dir.join(&name);
            if self.foreign(&sub) {
                continue;
            }
            let sub_path = if path == "/" {
                format!("/{name}")
            } else {
                format!("{path}/{name}")
            };
            self.group(m, &sub_path);
        }
    }

    /// Whether group `dir` holds a process outside the tree (or cannot
    /// say: a v2 threaded group lists no processes).
    fn foreign(&self, dir: &Path) -> bool {
        match proc::read_string(&dir.join("cgroup.procs").display().to_string()) {
            Ok(s) => s
                .split_whitespace()
                .any(|p| p.parse::<i32>().map_or(true, |p| !self.tree.contains(&p))),
            Err(_) => true,
        }
    }
}

/// Make the groups of `ck` (already placed, see [`super::place`]) that
/// are missing here, and write their owner, mode and settings.
pub fn make(ck: &Checkpoint) -> Result<(), RestoreError> {
    if ck.cgroup_dirs.is_empty() {
        return Ok(());
    }
    let mut here = Here::default();
    here.load()?;
    for d in &ck.cgroup_dirs {
        let Some(m) = here.mount(&d.controllers) else {
            continue;
        };
        let Some(dir) = dir_of(m, &d.path) else {
            continue;
        };
        if dir.is_dir() {
            continue;
        }
        super::make(&dir, m)
            .step(|| format!("cannot create cgroup {}:{}", d.controllers, d.path))?;
        set(d, &dir)?;
        debug!(hierarchy = %d.controllers, path = %d.path, "cgroup made with its settings");
    }
    Ok(())
}

/// Write group `d`'s owner, mode, settings and files' owners into `dir`,
/// which the restore just made.
fn set(d: &CgroupDir, dir: &Path) -> Result<(), RestoreError> {
    let group = || format!("cgroup {}:{}", d.controllers, d.path);
    let io = |what: String, e: std::io::Error| {
        RestoreError::Unsupported(format!("{}: {what}: {e}", group()))
    };
    for (name, value) in &d.settings {
        let Some((_, how, strict)) = SETTINGS.iter().find(|(n, _, _)| n == name) else {
            continue;
        };
        let path = dir.join(name);
        let now = proc::read_string(&path.display().to_string()).unwrap_or_default();
        if now.trim_end() == value {
            continue;
        }
        if let Err(e) = write_setting(dir, name, *how, value) {
            if *strict {
                return Err(RestoreError::Unsupported(format!(
                    "{}: cannot set {name} to {value:?} again: {e}",
                    group()
                )));
            }
            warn!(hierarchy = %d.controllers, path = %d.path, "cannot set {name} to {value:?} again: {e}");
        }
    }
    for (name, uid, gid, mode) in &d.files {
        let path = dir.join(name);
        if !path.exists() {
            continue;
        }
        std::os::unix::fs::chown(&path, Some(*uid), Some(*gid))
            .map_err(|e| io(format!("chown of {name}"), e))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(*mode))
            .map_err(|e| io(format!("chmod of {name}"), e))?;
    }
    std::os::unix::fs::chown(dir, Some(d.uid), Some(d.gid)).map_err(|e| io("chown".into(), e))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(d.mode))
        .map_err(|e| io("chmod".into(), e))?;
    Ok(())
}

/// Write control file `name` of group `dir` back from `value` as read.
fn write_setting(dir: &Path, name: &str, how: Write, value: &str) -> Result<(), cr_sys::SysError> {
    let put = |file: &str, v: &str| proc::write_string(&dir.join(file).display().to_string(), v);
    match how {
        Write::Plain => put(name, value),
        Write::Lines => value
            .lines()
            .filter(|l| !l.trim().is_empty())
            .try_for_each(|l| put(name, l)),
        Write::OomControl => match value
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill_disable "))
        {
            Some(v) => put(name, v.trim()),
            None => Ok(()),
        },
        Write::Devices => {
            if value.trim() == "a *:* rwm" {
                return Ok(());
            }
            put("devices.deny", "a")?;
            value
                .lines()
                .filter(|l| !l.trim().is_empty())
                .try_for_each(|l| put("devices.allow", l))
        }
        Write::Subtree => {
            let v = value
                .split_whitespace()
                .map(|c| format!("+{c}"))
                .collect::<Vec<_>>()
                .join(" ");
            if v.is_empty() {
                Ok(())
            } else {
                put(name, &v)
            }
        }
        Write::Type => {
            if value.trim() == "threaded" {
                put(name, "threaded")
            } else {
                Ok(())
            }
        }
    }
}
