//! The groups a restore makes, removed again when that restore fails.
//!
//! A restore makes the groups its image names that are missing here (the
//! processes' and threads' groups, the cgroup namespace's roots, the empty
//! groups the tree relies on, and the groups above them), in several steps
//! and threads. Rather than follow each `mkdir`, [`Leftovers::before`]
//! notes, once the image's groups are placed and before any is made, which
//! of all those directories do not exist yet; if the restore then fails,
//! dropping the [`Leftovers`] removes those that exist by then, deepest
//! first. A group is only ever removed empty (rmdir fails on one with
//! processes or subgroups), so one somebody else filled meanwhile stays.
//! The killed processes of a failed restore may still be leaving their
//! groups: a busy group is tried again for a moment.

use super::{dir_of, Here};
use crate::error::RestoreError;
use cr_image::model::Checkpoint;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tracing::{debug, warn};

/// How long a group still busy with the failed restore's dying processes
/// is tried again.
const BUSY_FOR: Duration = Duration::from_secs(5);

/// The group directories missing before a restore (see the module's docs).
#[derive(Debug, Default)]
pub struct Leftovers {
    missing: Vec<PathBuf>,
}

impl Leftovers {
    /// The groups of `ck` (as placed, see [`super::place`]) and the
    /// directories above them that do not exist yet.
    pub fn before(ck: &Checkpoint) -> Result<Leftovers, RestoreError> {
        let mut here = Here::default();
        here.load()?;
        let mut groups: Vec<(&str, &str)> = Vec::new();
        for p in &ck.processes {
            groups.extend(p.cgroups.iter().map(|c| (&*c.controllers, &*c.path)));
            for th in &p.threads {
                groups.extend(th.cgroups.iter().map(|c| (&*c.controllers, &*c.path)));
            }
        }
        for c in ck.cgroupns.iter().flatten() {
            groups.push((&c.controllers, &c.path));
        }
        groups.extend(ck.cgroup_dirs.iter().map(|d| (&*d.controllers, &*d.path)));
        let mut missing = Vec::new();
        for (controllers, path) in groups {
            let Some(m) = here.mount(controllers) else {
                continue;
            };
            let Some(mut dir) = dir_of(m, path) else {
                continue;
            };
            while dir.starts_with(&m.mount_point) && dir != m.mount_point && !dir.is_dir() {
                missing.push(dir.clone());
                if !dir.pop() {
                    break;
                }
            }
        }
        // Deepest first, each once.
        missing.sort_by(|a, b| {
            b.components()
                .count()
                .cmp(&a.components().count())
                .then_with(|| a.cmp(b))
        });
        missing.dedup();
        Ok(Leftovers { missing })
    }

    /// The restore succeeded: its groups stay.
    pub fn keep(&mut self) {
        self.missing.clear();
    }
}

impl Drop for Leftovers {
    fn drop(&mut self) {
        let until = Instant::now() + BUSY_FOR;
        for dir in self.missing.drain(..) {
            loop {
                match std::fs::remove_dir(&dir) {
                    Ok(()) => {
                        debug!(dir = %dir.display(), "group made by the failed restore removed");
                        break;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                    Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < until => {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(e) => {
                        warn!(dir = %dir.display(), "group made by the failed restore left: {e}");
                        break;
                    }
                }
            }
        }
    }
}
