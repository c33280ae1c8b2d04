//! `cr_checkpoint --check`: every resource of a tree and whether it can be
//! saved, without touching the processes (the same code as the pre-flight
//! of a checkpoint, asked to go on after a refusal and to look deeper).

use crate::kinds::{fds, memory, sysv, tree};
use crate::CheckpointError;
use cr_sys::proc;

/// One line of the report.
#[derive(Debug, Clone)]
pub struct CheckItem {
    pub pid: i32,
    /// "fd 3", "memory", "process".
    pub resource: String,
    pub what: String,
    /// Why it cannot be saved.
    pub refused: Option<String>,
}

/// List every resource of the tree under `pid` and whether it can be saved.
pub fn check(pid: i32) -> Result<Vec<CheckItem>, CheckpointError> {
    tree::validate(pid)?;
    let pids = tree::walk(pid)?;
    let mut tree_fds = fds::TreeFds::new(&pids);
    tree_fds.deep = true;
    let mut out = Vec::new();
    let mut tables = tree::Tables::default();
    for &p in &pids {
        let Ok(stat) = proc::stat(p) else {
            continue;
        };
        let item = |resource: &str, what: String, refused: Option<String>| CheckItem {
            pid: p,
            resource: resource.to_string(),
            what,
            refused,
        };
        if stat.state == 'Z' {
            out.push(item("process", format!("{} (zombie)", stat.comm), None));
            continue;
        }
        let threads = proc::tasks(p).map(|t| t.len()).unwrap_or(0);
        let (shared, refused) = match tables.add(p, stat.ppid) {
            Ok([files, fs]) => {
                let of = |o: Option<i32>, what: &str| o.map(|o| format!(", the {what} of {o}"));
                let shared = [of(files, "fd table"), of(fs, "working directory and umask")];
                (shared.into_iter().flatten().collect::<String>(), None)
            }
            Err(e) => (String::new(), Some(e.to_string())),
        };
        out.push(item(
            "process",
            format!(
                "{} ({threads} threads, credentials, signals, timers, seccomp{shared})",
                stat.comm
            ),
            refused,
        ));
        let maps = proc::maps(p).map_err(|e| CheckpointError::from_sys(p, e))?;
        let bad: Vec<String> = maps
            .iter()
            .filter_map(|m| memory::dump::classify(p, m).err())
            .map(|e| cr_sys::error::one_line(&e))
            .collect();
        out.push(item(
            "memory",
            format!("{} mappings", maps.len()),
            (!bad.is_empty()).then(|| bad.join("; ")),
        ));
        for r in fds::report(p, &mut tree_fds) {
            out.push(item(&format!("fd {}", r.fd), r.what, r.refused));
        }
    }
    out.push(CheckItem {
        pid,
        resource: "ipc".into(),
        what: sysv::summary(pid, &pids),
        refused: None,
    });
    Ok(out)
}
