//! The daemons' fault hooks as tests drive them (docs/CLUSTER.md, "Test
//! hooks"): `CR_AGENT_FAULT=@FILE` / `CR_COORD_FAULT=@FILE` read the step
//! to stop at from a control file the test writes before each scenario,
//! and touch a file when the step is reached.

use crate::cluster::{Cluster, Ring};
use crate::read_text;
use crate::wait_until;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The fault hooks: a control file per daemon and the file a fault point
/// touches when reached.
pub struct Faults {
    pub agent_ctl: PathBuf,
    pub agent_reached: PathBuf,
    pub coord_ctl: PathBuf,
    pub coord_reached: PathBuf,
}

impl Faults {
    pub fn new(dir: &Path) -> Faults {
        let f = Faults {
            agent_ctl: dir.join("agent-fault"),
            agent_reached: dir.join("agent-fault-reached"),
            coord_ctl: dir.join("coord-fault"),
            coord_reached: dir.join("coord-fault-reached"),
        };
        f.clear();
        f
    }

    pub fn clear(&self) {
        for p in [&self.agent_ctl, &self.coord_ctl] {
            std::fs::write(p, "").expect("write a fault control file");
        }
        let _ = std::fs::remove_file(&self.agent_reached);
        let _ = std::fs::remove_file(&self.coord_reached);
    }

    pub fn agent_env(&self) -> Vec<(String, String)> {
        hook_env("CR_AGENT", &self.agent_ctl, &self.agent_reached)
    }

    pub fn coord_env(&self) -> Vec<(String, String)> {
        hook_env("CR_COORD", &self.coord_ctl, &self.coord_reached)
    }
}

/// `PREFIX_FAULT=@CTL` and `PREFIX_FAULT_FILE=REACHED`.
fn hook_env(prefix: &str, ctl: &Path, reached: &Path) -> Vec<(String, String)> {
    vec![
        (format!("{prefix}_FAULT"), format!("@{}", ctl.display())),
        (
            format!("{prefix}_FAULT_FILE"),
            reached.display().to_string(),
        ),
    ]
}

/// Starts `crctl ARGS` in the background and waits until the fault point
/// `reached` is touched; returns the running crctl.
pub fn run_to_fault(
    c: &Cluster,
    ring: &Ring,
    args: &[&str],
    reached: &Path,
) -> crate::cluster::Spawned {
    let mut ck = c.crctl_bg(args);
    let (o, e) = (ck.stdout.clone(), ck.stderr.clone());
    wait_until(
        &format!(
            "crctl {args:?} to reach the fault point ({})",
            reached.display()
        ),
        Duration::from_secs(60),
        || reached.exists() || ck.proc.has_exited(),
        || {
            format!(
                "--- crctl stdout:\n{}\n--- stderr:\n{}\n{}",
                read_text(&o),
                read_text(&e),
                ring.diag()
            )
        },
    );
    if !reached.exists() {
        panic!(
            "crctl {args:?} ended before the fault point\n{}\n{}",
            ck.diag(),
            ring.diag()
        );
    }
    ck
}
