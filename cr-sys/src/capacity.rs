//! What a node can take: memory free for new processes, CPUs and load, as
//! the agent reports them to the coordinator (drain placement).
//!
//! Memory is MemAvailable of /proc/meminfo, lowered by the node's cgroup v2
//! when it has limits: a node modelled as a cgroup (a container) has
//! `memory.max - memory.current` free in the group and each of its
//! ancestors that sets `memory.max`, whatever the host's MemAvailable says.
//! CPUs are those the caller may run on (sched_getaffinity), lowered by the
//! cgroup's `cpu.max` quota (quota/period) the same way; the load is the
//! host's 1-minute loadavg.

use crate::error::{Result, SysError};
use std::path::{Path, PathBuf};

/// A node's capacity (see the module doc).
#[derive(Debug, Clone, PartialEq)]
pub struct Capacity {
    /// Bytes free for new processes.
    pub mem_free: u64,
    /// "meminfo", or the cgroup directory whose limit gave `mem_free`.
    pub mem_source: String,
    /// CPUs available (fractional under a cpu.max quota).
    pub cpus: f64,
    /// 1-minute load average.
    pub load: f64,
}

/// Read the capacity now. `cgroup`: the node's cgroup v2 directory; None:
/// our own cgroup (none found, or cgroup v1: MemAvailable and affinity
/// only).
pub fn read(cgroup: Option<&Path>) -> Result<Capacity> {
    let mut mem_free = crate::proc::mem_available()?;
    let mut mem_source = "meminfo".to_string();
    let mut cpus = crate::sched::affinity(0)?.len() as f64;
    let dir = match cgroup {
        Some(d) => Some(d.to_path_buf()),
        None => own_cgroup(),
    };
    if let Some(dir) = dir {
        for d in dir
            .ancestors()
            .take_while(|d| d.join("cgroup.procs").exists())
        {
            if let Some(free) = cgroup_mem_free(d)? {
                if free < mem_free {
                    mem_free = free;
                    mem_source = d.display().to_string();
                }
            }
            if let Some(q) = cgroup_cpu_quota(d)? {
                cpus = cpus.min(q);
            }
        }
    }
    Ok(Capacity {
        mem_free,
        mem_source,
        cpus,
        load: loadavg()?,
    })
}

/// Our own cgroup v2 directory, if the unified hierarchy is mounted here.
fn own_cgroup() -> Option<PathBuf> {
    let me = std::process::id() as i32;
    let (_, path) = crate::proc::cgroups(me)
        .ok()?
        .into_iter()
        .find(|(c, _)| c.is_empty())?;
    let m = crate::proc::cgroup_mounts()
        .ok()?
        .into_iter()
        .find(|m| m.controllers.is_empty())?;
    let rel = path.strip_prefix(&m.root)?.trim_start_matches('/');
    Some(m.mount_point.join(rel))
}

/// `memory.max - memory.current` of group `dir`; None: no limit there (or
/// no memory controller).
fn cgroup_mem_free(dir: &Path) -> Result<Option<u64>> {
    let Some(max) = read_opt(&dir.join("memory.max"))? else {
        return Ok(None);
    };
    let Some(max) = parse_limit(&max, &dir.join("memory.max"))? else {
        return Ok(None);
    };
    let cur_path = dir.join("memory.current");
    let cur = match read_opt(&cur_path)? {
        Some(t) => parse_u64(&t, &cur_path)?,
        None => 0,
    };
    Ok(Some(max.saturating_sub(cur)))
}

/// CPUs of the `cpu.max` quota of group `dir`; None: no quota there.
fn cgroup_cpu_quota(dir: &Path) -> Result<Option<f64>> {
    let path = dir.join("cpu.max");
    let Some(text) = read_opt(&path)? else {
        return Ok(None);
    };
    parse_cpu_max(&text, &path)
}

/// "QUOTA PERIOD" of cpu.max as CPUs; "max ..." is none.
fn parse_cpu_max(text: &str, path: &Path) -> Result<Option<f64>> {
    let mut it = text.split_whitespace();
    let (Some(q), Some(p)) = (it.next(), it.next()) else {
        return Err(bad(path, text));
    };
    if q == "max" {
        return Ok(None);
    }
    let (q, p) = (parse_u64(q, path)?, parse_u64(p, path)?);
    if p == 0 {
        return Err(bad(path, text));
    }
    Ok(Some(q as f64 / p as f64))
}

/// A byte limit: "max" is none.
fn parse_limit(text: &str, path: &Path) -> Result<Option<u64>> {
    match text.trim() {
        "max" => Ok(None),
        t => parse_u64(t, path).map(Some),
    }
}

/// Resident memory of process `pid` and its descendants, in bytes
/// (VmRSS summed: pages shared between them count once per process). 0 if
/// `pid` is gone; a descendant that exits meanwhile is skipped.
pub fn tree_rss(pid: i32) -> u64 {
    let mut total = 0;
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        if let Ok(st) = crate::proc::status(p) {
            total += st.vmrss.unwrap_or(0) * 1024;
        }
        todo.extend(crate::proc::children(p).unwrap_or_default());
    }
    total
}

/// The 1-minute load average (/proc/loadavg).
pub fn loadavg() -> Result<f64> {
    let path = Path::new("/proc/loadavg");
    let text = crate::proc::read_string("/proc/loadavg")?;
    text.split_whitespace()
        .next()
        .and_then(|f| f.parse().ok())
        .ok_or_else(|| bad(path, &text))
}

fn parse_u64(text: &str, path: &Path) -> Result<u64> {
    text.trim().parse().map_err(|_| bad(path, text))
}

fn bad(path: &Path, text: &str) -> SysError {
    SysError::Parse {
        path: path.display().to_string(),
        what: format!("unexpected content {:?}", text.trim()),
    }
}

/// A cgroup file's content; None: the group has no such file (controller
/// not enabled there).
fn read_opt(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(crate::error::io_err(path.display().to_string())(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_max_and_limits() {
        let p = Path::new("cpu.max");
        assert_eq!(parse_cpu_max("max 100000\n", p).unwrap(), None);
        assert_eq!(parse_cpu_max("150000 100000\n", p).unwrap(), Some(1.5));
        assert!(parse_cpu_max("150000 0", p).is_err());
        assert!(parse_cpu_max("junk", p).is_err());
        assert_eq!(parse_limit("max\n", p).unwrap(), None);
        assert_eq!(parse_limit("1048576\n", p).unwrap(), Some(1 << 20));
    }

    #[test]
    fn reads_this_machine() {
        let c = read(None).unwrap();
        assert!(c.mem_free > 0, "{c:?}");
        assert!(c.cpus > 0.0, "{c:?}");
        assert!(c.load >= 0.0, "{c:?}");
        assert!(tree_rss(std::process::id() as i32) > 0);
    }
}
