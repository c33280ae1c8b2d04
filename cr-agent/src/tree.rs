//! The process tree under a root: walking it, and freezing it top-down.
//!
//! A frozen process cannot fork, so freezing parents before reading their
//! children gives a stable tree: children that appear while we work are
//! found when their (now frozen) parent is read.

use crate::{threads, CheckpointError};
use cr_sys::proc;
use cr_sys::ptrace::Tracee;
use std::collections::{BTreeSet, VecDeque};

/// A process of the tree, frozen (or a zombie, which needs no freezing).
pub struct Frozen {
    pub pid: i32,
    /// Every thread, main first; empty for a zombie.
    pub tracees: Vec<Tracee>,
    /// Was in a job-control stop before we came.
    pub stopped: bool,
    /// Wait status of a zombie not yet reaped.
    pub zombie: Option<i32>,
}

/// `root` and its descendants as they are now (not frozen), root first.
pub fn walk(root: i32) -> Result<Vec<i32>, CheckpointError> {
    let mut out = Vec::new();
    let mut queue = VecDeque::from([root]);
    let mut seen = BTreeSet::from([root]);
    while let Some(pid) = queue.pop_front() {
        out.push(pid);
        for c in proc::children(pid).unwrap_or_default() {
            if seen.insert(c) {
                queue.push_back(c);
            }
        }
    }
    Ok(out)
}

/// Freeze `root` and all its descendants, parents before children.
pub fn freeze(root: i32) -> Result<Vec<Frozen>, CheckpointError> {
    let mut out = Vec::new();
    let mut queue = VecDeque::from([root]);
    let mut seen = BTreeSet::from([root]);
    while let Some(pid) = queue.pop_front() {
        let stat = match proc::read_stat(pid) {
            Ok(s) => s,
            Err(_) if pid != root => continue, // exited and reaped meanwhile
            Err(_) => return Err(CheckpointError::NoSuchProcess(pid)),
        };
        if stat.state == 'Z' && pid != root {
            out.push(zombie(pid, &stat));
            continue;
        }
        let tracees = match threads::seize_all(pid) {
            Ok(t) => t,
            Err(e) if pid != root => match proc::read_stat(pid) {
                // It exited after we froze its parent: now a zombie.
                Ok(s) if s.state == 'Z' => {
                    out.push(zombie(pid, &s));
                    continue;
                }
                _ => return Err(e),
            },
            Err(e) => return Err(e),
        };
        out.push(Frozen {
            pid,
            tracees,
            stopped: stat.state == 'T',
            zombie: None,
        });
        for c in proc::children(pid).map_err(|e| CheckpointError::from_sys(pid, e))? {
            if seen.insert(c) {
                queue.push_back(c);
            }
        }
    }
    Ok(out)
}

fn zombie(pid: i32, stat: &proc::Stat) -> Frozen {
    Frozen {
        pid,
        tracees: Vec::new(),
        stopped: false,
        zombie: Some(stat.field(52) as i32),
    }
}
